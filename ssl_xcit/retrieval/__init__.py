"""Image-retrieval evaluation of frozen backbones (XCiT appendix D.3): CLS, VLAD and ASMK descriptors on
Revisited Oxford/Paris, INRIA Holidays, UKBench and user benchmarks in a JSON format.

    >>> from ssl_xcit.retrieval import RetrievalConfig, run_retrieval
    >>> run_retrieval(RetrievalConfig("holidays", "data/holidays", method="vlad", weights="w.pth",
    ...                               train_images="data/flickr"))
"""

from ssl_xcit.retrieval.asmk_index import AsmkIndex, asmk_params
from ssl_xcit.retrieval.datasets import (
    DATASETS,
    ImageList,
    RetrievalDataset,
    list_images,
    load_dataset,
    load_holidays,
    load_json_benchmark,
    load_resized,
    load_revisited,
    load_revisited_gnd,
    load_ukbench,
)
from ssl_xcit.retrieval.descriptors import MULTISCALE, extract_global, extract_local, select_local
from ssl_xcit.retrieval.metrics import (
    average_precision,
    holidays_map,
    map_and_precision,
    revisited_metrics,
    ukbench_ns_score,
)
from ssl_xcit.retrieval.pca import PCA
from ssl_xcit.retrieval.pipeline import METHODS, RetrievalConfig, format_table, run_retrieval
from ssl_xcit.retrieval.vlad import train_codebook, vlad, vlad_batch

__all__ = [
    "DATASETS",
    "METHODS",
    "MULTISCALE",
    "PCA",
    "AsmkIndex",
    "ImageList",
    "RetrievalConfig",
    "RetrievalDataset",
    "asmk_params",
    "average_precision",
    "extract_global",
    "extract_local",
    "format_table",
    "holidays_map",
    "list_images",
    "load_dataset",
    "load_holidays",
    "load_resized",
    "load_json_benchmark",
    "load_revisited",
    "load_revisited_gnd",
    "load_ukbench",
    "map_and_precision",
    "revisited_metrics",
    "run_retrieval",
    "select_local",
    "train_codebook",
    "ukbench_ns_score",
    "vlad",
    "vlad_batch",
]
