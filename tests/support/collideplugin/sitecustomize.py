"""Forced 64-bit hash collisions for the tests of the count path over keys, kept out of the
shipped code.

Put this folder on PYTHONPATH and set SHARDDEMO_TEST_COLLIDE=A=B,C=D: in every rank of the
launch, key A then gets key B's 64-bit hash (its check, the other 64 bits, stays its own), so
A and B collide as two keys whose hashes agree by chance would. Without the variable it does
nothing.
"""

import os

SPEC = os.environ.get("SHARDDEMO_TEST_COLLIDE")


def forcing(real, pairs: dict):
    """key_hashes with key A of `pairs` given key B's 64-bit hash (tests/ranks/test_keys.py uses it
    in its own process too)."""

    def key_hashes(keys):
        hashes, checks = real(keys)
        for k, key in enumerate(keys):
            if key in pairs:
                hashes[k] = real([pairs[key]])[0][0]
        return hashes, checks

    return key_hashes


if SPEC and "RANK" in os.environ:
    import sharddemo.rank.keys as _keys

    _keys.key_hashes = forcing(_keys.key_hashes,
                               dict(part.split("=", 1) for part in SPEC.split(",")))
