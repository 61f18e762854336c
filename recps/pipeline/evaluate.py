"""The funnel's end-to-end evaluation on held-out requests (issue 16 point 5).

For each held-out request (a test user and the items it liked afterwards) the trained funnel runs as it
serves (recps.pipeline.funnel.Funnel.run: recall over the item index without seen items, then each
ranker on what it receives), and we report:

    per stage    pass_through: held-out positives that survive the stage / those that reached it
                 (recall: / all positives); hits: positives it kept
    recall       recall@K and ndcg@K at its keep size K
    rankers      auc, gauc (grouped by user) and pnr (positive/negative order ratio) of its scores on
                 the candidates it received, a positive = a held-out positive
    funnel       ndcg@N, hr@N (a request with at least one positive in the final top N), recall@N;
                 on a generated world utility_ndcg@N, the list's DCG of true utility over the ideal list's;
                 agreement: the share of fine's top-k over recall's candidates (coarse skipped) that
                 coarse kept (k: the stage after coarse's keep)
    baselines    most_popular (training clicks, seen items excluded), recall_alone (its top N),
                 recall_plus_fine_without_coarse (the funnel with coarse skipped); on a generated world,
                 ideal (the world's own best list)

Ranking metrics come from recps.metrics (NDCGAtK, RecallAtK, GroupedAUC, PNR); hits are vectorized
(request * I + item keys against the sorted positives' keys).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from omegaconf import DictConfig

from recps.metrics.grouped import PNR, GroupedAUC
from recps.metrics.retrieval import NDCGAtK, RecallAtK
from recps.pipeline.data import Csr
from recps.pipeline.funnel import Funnel

__all__ = ["evaluate_funnel", "hits", "most_popular"]

log = logging.getLogger("recps.pipeline")


def hits(lists: torch.Tensor, positives: Csr, num_items: int) -> torch.Tensor:
    """(B, K) bool: whether item lists[b, k] is a positive of row b of `positives` (-1 pads never are)."""
    b = lists.shape[0]
    rows = torch.arange(b).unsqueeze(1)
    keys = torch.where(lists >= 0, rows * num_items + lists, torch.full_like(lists, -1))  # (B, K)
    wanted = positives.row_ids() * num_items + positives.items  # (P,)
    return torch.isin(keys, wanted)


def most_popular(funnel: Funnel, users: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n) the most clicked training items each user has not seen."""
    data = funnel.data
    order = torch.argsort(data.popularity(), descending=True)  # (I,)
    seen = data.seen.rows(users)
    take = min(order.numel(), n + int(seen.offsets.diff().max()) if users.numel() else n)
    cand = order[:take].unsqueeze(0).expand(users.numel(), -1)  # (B, C)
    is_seen = hits(cand, seen, data.num_items)  # (B, C)
    rank = torch.where(is_seen, torch.full_like(cand, take), torch.arange(take).expand_as(cand))
    picked = torch.argsort(rank, dim=1, stable=True)[:, :n]
    out = cand.gather(1, picked)
    return torch.where(rank.gather(1, picked) < take, out, torch.full_like(out, -1))


class _ListMetrics:
    """ndcg@N, recall@N, hr@N of ranked lists against positives."""

    def __init__(self, n: int, utility=None) -> None:
        self.n = n
        self.utility_of = utility  # (users, lists) -> (B,) utility NDCG against the ideal list (generated data)
        self.utility = 0.0
        self.ndcg, self.recall = NDCGAtK(n), RecallAtK(n)
        self.hit_requests = 0.0
        self.requests = 0

    def update(self, lists: torch.Tensor, targets: torch.Tensor, hit: torch.Tensor,
               users: torch.Tensor | None = None) -> None:
        if self.utility_of is not None and users is not None:
            self.utility += float(self.utility_of(users, lists[:, : self.n]).sum())
        self.ndcg.update_ranked(lists[:, : self.n], targets)
        self.recall.update_ranked(lists[:, : self.n], targets)
        self.hit_requests += float(hit[:, : self.n].any(1).sum())
        self.requests += int(lists.shape[0])

    def compute(self) -> dict[str, float]:
        n = self.n
        out = {f"ndcg@{n}": self.ndcg.compute(), f"hr@{n}": self.hit_requests / max(1, self.requests),
               f"recall@{n}": self.recall.compute()}
        if self.utility_of is not None:
            out[f"utility_ndcg@{n}"] = self.utility / max(1, self.requests)
        return out


def evaluate_funnel(funnel: Funnel, cfg: DictConfig) -> dict[str, Any]:
    """The metrics of the module docstring on the held-out requests of funnel.data."""
    data = funnel.data
    p = cfg.pipeline
    n = int(p.top_n)
    specs = funnel.specs
    first, final = specs[0], specs[-1]
    requests = torch.arange(data.test_users.numel())
    if int(p.get("eval_users") or 0) > 0:
        requests = requests[: int(p.eval_users)]
    batch = int(p.get("eval_batch_users") or 256)
    skip = specs[1].name if len(specs) > 2 else None  # coarse: the baseline without it
    after_skip = specs[2].name if skip else None
    hits_of = {s.name: 0.0 for s in specs}
    total_pos = 0.0
    recall_lists = _ListMetrics(first.keep)
    final_lists, alone, popular, no_coarse, ideal = (_ListMetrics(n, data.utility_ndcg) for _ in range(5))
    rankers = {s.name: (GroupedAUC(name="auc"), GroupedAUC(name="gauc"), PNR()) for s in specs[1:]}
    agree, agree_total = 0.0, 0.0
    seconds = {s.name: 0.0 for s in specs}
    final_kept: list[torch.Tensor] = []  # the final lists, request by request (recommend is checked against them)
    start = time.perf_counter()
    for part in requests.split(batch):
        users = data.test_users[part]
        positives = data.test_positives.rows(part)
        targets = positives.padded(-1)  # (B, P)
        total_pos += float(positives.items.numel())
        out = funnel.run(users, record_inputs=True)
        for s in specs:
            seconds[s.name] += out.seconds[s.name]
            kept_hits = hits(out.kept[s.name], positives, data.num_items)
            hits_of[s.name] += float(kept_hits.sum())
            if s.upstream is not None:
                received = out.inputs[s.name]
                valid = received >= 0
                labels = hits(received, positives, data.num_items)[valid].to(torch.float32)
                scores = out.input_scores[s.name][valid]
                groups = users.unsqueeze(1).expand_as(received)[valid]
                auc, gauc, pnr = rankers[s.name]
                auc.update(scores, labels, torch.zeros_like(groups))
                gauc.update(scores, labels, groups)
                pnr.update(scores, labels, groups)
        recall_kept = out.kept[first.name]
        recall_lists.update(recall_kept, targets, hits(recall_kept, positives, data.num_items))
        top = out.kept[final.name]
        final_kept.append(top)
        final_lists.update(top, targets, hits(top, positives, data.num_items), users)
        alone.update(recall_kept, targets, hits(recall_kept, positives, data.num_items), users)
        pop = most_popular(funnel, users, n)
        popular.update(pop, targets, hits(pop, positives, data.num_items), users)
        if skip:
            without = funnel.run(users, skip={skip})
            w_final = without.kept[final.name]
            no_coarse.update(w_final, targets, hits(w_final, positives, data.num_items), users)
            top = without.kept[after_skip]  # (B, k) fine's top over recall's candidates
            valid = top >= 0
            coarse_kept = out.kept[skip]
            rows = torch.arange(users.numel()).unsqueeze(1)
            in_coarse = torch.isin(rows * data.num_items + top, rows * data.num_items + coarse_kept)
            agree += float((in_coarse & valid).sum())
            agree_total += float(valid.sum())
        if data.ideal is not None:
            best = data.ideal(users, n, data.seen.rows(users))
            ideal.update(best, targets, hits(best, positives, data.num_items), users)
    wall = time.perf_counter() - start
    stages: dict[str, dict[str, Any]] = {}
    reached = total_pos
    for s in specs:
        row: dict[str, Any] = {"keep": s.keep, "pass_through": hits_of[s.name] / reached if reached else float("nan"),
                               "hits": hits_of[s.name]}
        if s.upstream is None:
            row.update(recall_lists.compute())
        else:
            auc, gauc, pnr = rankers[s.name]
            row.update(auc=auc.compute(), gauc=gauc.compute(), pnr=pnr.compute())
        stages[s.name] = row
        reached = hits_of[s.name]
    funnel_metrics: dict[str, Any] = dict(final_lists.compute())
    funnel_metrics["hit_rate"] = hits_of[final.name] / total_pos if total_pos else float("nan")
    if skip:
        funnel_metrics["agreement"] = agree / agree_total if agree_total else float("nan")
    baselines = {"most_popular": popular.compute(), "recall_alone": alone.compute()}
    if skip:
        baselines[f"recall_without_{skip}"] = no_coarse.compute()
    if data.ideal is not None:
        baselines["ideal"] = ideal.compute()
    users_n = int(requests.numel())
    latency = {s.name: 1000.0 * seconds[s.name] / max(1, users_n) for s in specs}
    return {"stages": stages, "funnel": funnel_metrics, "baselines": baselines, "requests": users_n,
            "positives": total_pos, "eval_seconds": wall,
            "latency_ms_per_user": latency, "users_per_sec": users_n / max(1e-9, sum(seconds.values())),
            "final_lists": {"users": data.test_users[requests].tolist(),
                            "items": (torch.cat(final_kept) if final_kept else torch.zeros(0, n)).tolist()}}
