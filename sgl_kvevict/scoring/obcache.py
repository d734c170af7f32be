"""OBCache scores (Optimal Brain KV cache pruning): the window's output error of pruning a token.

Per query head ``h`` and candidate ``p``, summed over the window queries ``i`` (OBCache Eq. 4-6; the
statistics are defined in ``window.py``):

* value: ``sum_i A^2 ||v_p||^2``, the exact ``||dO||_F^2`` of zeroing ``v_p`` (O is linear in V);
* key:   ``sum_i A^2 Z^2 ||v_p - o_i||^2``, second order in zeroing ``k_p``;
* joint: ``sum_i A^2 ||(1 + Z) v_p - Z o_i||^2``, both (the compact form of Eq. 6, docs/methods/obcache.md#compact-joint-form).

Under GQA the scores are summed over the query heads of a KV group (Eq. 33-35: the objective is the
group's total output error); that is the default ``gqa="sum"`` these scores bring (``scoring.SCORE_KINDS``).
"""

from __future__ import annotations

import torch

from sgl_kvevict.settings import CommonSettings, Settings
from sgl_kvevict.scoring.base import QueryHeadScorer, Reduction
from sgl_kvevict.scoring.window import StatsRequest, WindowStats

_FIELD_OF_SCORE = {"obc-value": "obc_value", "obc-key": "obc_key", "obc-joint": "obc_joint"}


class OBCacheScorer(QueryHeadScorer):
    """One of the three OBCache scores, named as the ``score`` knob (``obc-value`` ...)."""

    def __init__(self, score: str, reduction: Reduction):
        super().__init__(reduction)
        self.field = _FIELD_OF_SCORE[score]
        self.request = StatsRequest(**{self.field: True})

    @classmethod
    def of(cls, common: CommonSettings, knobs: Settings, reduction: Reduction) -> "OBCacheScorer":
        return cls(common.score, reduction)

    def query_head_scores(self, stats: WindowStats, candidates: slice) -> torch.Tensor:
        return getattr(stats, self.field)[:, candidates]
