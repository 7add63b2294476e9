"""ssl_xcit: DINO self-supervised pretraining of XCiT backbones, and frozen-feature evaluation.

The subpackages import one way (tests/test_import_order.py holds the order): ``errors``, ``utils`` ->
``data`` -> ``models`` -> ``evaluation`` -> ``retrieval`` -> ``visualize`` -> ``parallel`` (sharding, meta start,
synced BatchNorm, cross-rank checks, checkpoint IO) -> ``dino`` (the objective and its LightningModule) ->
``trainer`` (the run's callbacks, memory plan) -> ``cli``. Old module paths that saved configs name resolve
through ``ssl_xcit._renamed``.
"""

from ssl_xcit import _renamed

_renamed.install()

__version__ = "0.1.0"
