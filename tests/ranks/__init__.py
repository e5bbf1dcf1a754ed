"""Tests that start processes: real gloo ranks (accelerate launch, torchrun, the sharddemo CLI),
pip, a Ray session. Each is marked `ranks` by this folder (tests/conftest.py)."""
