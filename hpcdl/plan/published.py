"""Published large-batch ImageNet runs on Xeon clusters, as data for ``hpcdl plan --validate``.

Papers count *processors* (sockets), the scheduler counts *nodes*. A Stampede2 SKX node holds two Xeon
Platinum 8160 (2 x 24 cores, 192 GB), so its processors are twice its nodes; a KNL node holds one Xeon
Phi 7250 (68 cores, 96 GB plus 16 GB MCDRAM), so the two counts agree. Every row keeps what the source
says (``processors`` of ``processor``) and derives the nodes from it; throughput rows give images per
second for the whole job.
"""

from __future__ import annotations

import dataclasses

__all__ = ["PROCESSORS_PER_NODE", "PUBLISHED", "PublishedRun"]

PROCESSORS_PER_NODE = {"Xeon Platinum 8160": 2, "Xeon Phi 7250": 1}  # Stampede2 SKX and KNL nodes

YOU_ARXIV = "You, Zhang, Hsieh, Demmel, Keutzer: ImageNet Training in Minutes, arXiv:1709.05011"
YOU_ICPP = "You, Zhang, Hsieh, Demmel, Keutzer: ImageNet Training in Minutes, ICPP 2018"
SURFSARA = ("Codreanu, Podareanu, Saletore (SURFsara, Intel): Scale out for large minibatch SGD: Residual "
            "network training on ImageNet-1K with improved accuracy and reduced time to train, 2017")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PublishedRun:
    name: str
    model: str  # hpcdl's model name
    processors: int  # as the source counts them
    processor: str  # a key of PROCESSORS_PER_NODE
    global_batch: int
    epochs: float | None  # None for a throughput row
    minutes: float | None = None  # time to train, when the row is one
    images_per_s: float | None = None  # the whole job's, when the row is a throughput
    source: str
    note: str = ""

    @property
    def nodes(self) -> int:
        per_node = PROCESSORS_PER_NODE[self.processor]
        if self.processors % per_node:
            raise ValueError(f"{self.name}: {self.processors} x {self.processor} is no whole number of nodes")
        return self.processors // per_node

    @property
    def batch_per_node(self) -> float:
        return self.global_batch / self.nodes


PUBLISHED: tuple[PublishedRun, ...] = (
    PublishedRun(name="surfsara-64", model="resnet50", processors=128, processor="Xeon Platinum 8160",
                 global_batch=64 * 64, epochs=None, images_per_s=98.5 * 64, source=SURFSARA,
                 note="the calibration row: 98.5 img/s per node at 64 images per node, Intel Caffe"),
    PublishedRun(name="resnet50-skx1024", model="resnet50", processors=1024, processor="Xeon Platinum 8160",
                 global_batch=32768, epochs=90, minutes=48, source=YOU_ICPP),
    PublishedRun(name="resnet50-skx1600", model="resnet50", processors=1600, processor="Xeon Platinum 8160",
                 global_batch=32768, epochs=90, minutes=32, source=YOU_ICPP),
    PublishedRun(name="resnet50-knl2048", model="resnet50", processors=2048, processor="Xeon Phi 7250",
                 global_batch=32768, epochs=90, minutes=20, source=YOU_ICPP),
    PublishedRun(name="alexnet-cpu1024", model="alexnet_bn", processors=1024, processor="Xeon Platinum 8160",
                 global_batch=32768, epochs=100, minutes=11, source=YOU_ARXIV,
                 note="arXiv's count, '1,024 CPUs'; the ICPP version says 2,048 Xeon 8160 for the same 11 minutes"),
    PublishedRun(name="alexnet-skx2048", model="alexnet_bn", processors=2048, processor="Xeon Platinum 8160",
                 global_batch=32768, epochs=100, minutes=11, source=YOU_ICPP,
                 note="the ICPP version's count for the run arXiv gives as 1,024 CPUs"),
    PublishedRun(name="surfsara-448", model="resnet50", processors=896, processor="Xeon Platinum 8160",
                 global_batch=14336, epochs=None, images_per_s=30200, source=SURFSARA,
                 note="about 30,200 img/s on 448 SKX nodes"),
)
