"""ssl_xcit: DINO self-supervised pretraining of XCiT backbones, and frozen-feature evaluation.

Data flows one way through the subpackages:
``data`` -> ``models`` -> ``dino`` (objective + LightningModule) -> ``evaluation`` / ``retrieval``.
"""

__version__ = "0.1.0"
