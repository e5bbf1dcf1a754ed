"""What the tests share and import: `support.launch` (starting ranks and commands, for
tests/ranks/ only), `support.oracle` (the libraries' own batches for each rank: the expected
values), `support.sim` (accelerate's prepared loaders for each rank in one process),
`support.factories` (the loaders `sharddemo audit` builds from a file), `support.reports` (a watch
report read back), `support.ray_loop` (the loop Ray's workers import), and the `*plugin` folders,
each a sitecustomize.py a test puts on a launch's PYTHONPATH to hide a package (hideplugin),
inject a fault (faultplugin) or force a key-hash collision (collideplugin) in every process."""
