"""The funnel's end-to-end evaluation on held-out requests (issue 16 point 5), merged over workers.

For each held-out request (a test user and the items it liked afterwards) the trained funnel runs as it
serves (recps.pipeline.funnel.Funnel.run: recall over the item index without seen items, then each
ranker on what it receives), and we report:

    per stage    pass_through: held-out positives that survive the stage / those that reached it
                 (recall: / all positives), pass_through_low95 / _high95 its Wilson 95% interval (positives
                 counted as independent trials), chance what keeping at random would pass (each
                 positive survives with kept / received of its request; recall: keep / the unseen
                 catalogue); hits: positives it kept; on a generated world (FunnelData.click_prob) a
                 ranker's ideal_pass_through, what keeping its `keep` best of the same input by the
                 world's true P(click) passes: the most any ranker of that input keeps in expectation
    recall       recall@K, ndcg@K and hr@K at its keep size K
    rankers      auc, gauc (grouped by user) and pnr (positive/negative order ratio) of its scores on
                 the candidates it received that the held-out requests showed (all it received when
                 the data does not say what was shown), label: the user clicked it
    funnel       ndcg@N, hr@N (a request with a positive in the final top N, over requests with one),
                 recall@N; on a generated world utility_ndcg@N, the list's DCG of true utility over
                 the ideal list's; hit_rate: positives in the final list / all positives; agreement:
                 the share of fine's top-k over recall's candidates (coarse skipped) that coarse kept
                 (k: the stage after coarse's keep); logged_ndcg@N, logged_hr@N, logged_recall@N when
                 the held-out positives are not the logged ones (below)
    baselines    most_popular (training clicks, seen items excluded), recall_alone (its top N),
                 recall_without_<coarse> (the funnel with coarse skipped); ease (Steck, WWW 2019:
                 recps.pipeline.ease, fitted on the training interactions, its L2 weight chosen on a
                 validation split of the training data: each user's latest `validation_fraction` of
                 training rows, never the held-out requests; `pipeline.baselines.ease`); sasrec (SASRec
                 alone over the whole catalogue, recps.pipeline.sasrec_alone, its epochs chosen the same
                 way; `pipeline.baselines.sasrec`, when the config has it); on a generated
                 world, ideal (the world's own best list); the same list metrics
    verdicts     one line per baseline, "funnel beats ease: no (0.0710 vs 0.1010)" (ndcg@N)

EASE is fitted once per run, by worker 0, which scores every held-out request with it (the other workers
add nothing to its sums, so the merged metric is the one-worker metric); `metrics["ease"]` holds the λ
chosen, the validation NDCG@N of every λ of the grid and the fit's seconds: a Cholesky fit per λ of the
grid, then one on all training interactions, in float32, over the `max_items` most interacted items (the
cost grows with their cube: on this 2-core machine under load one fit took 7 s at 4,000 items, ~80 s at
9,000; a grid evaluated from one eigendecomposition was slower, eigh 134 s at 4,000 items).

Which held-out positives: `FunnelData.test_positives`. On the generated world with a random bucket
(`random_items_per_user` > 0, datasets/video_world.md) they are the clicks of each user's random-bucket
request: items shown uniformly at random among those the user has not seen, so a list's hits estimate the
clicks it would get, unbiased by the logging policy; the logged test clicks (exposed by the
popularity-biased policy, where imitating exposure scores) are `logged_positives`, reported as logged_*.
On real data (MovieLens) the logged held-out ratings are the positives.

Merged over workers (never pickled): worker w of W evaluates requests w, w + W, ...; every metric is a
(numerator, denominator) sum in a recps.metrics.funnel.FunnelTally (a user's request is one row, on one
worker, so GAUC and PNR decompose per user) and the rankers' AUCs are GroupedAUC columns; both merge
through the `merger` (recps.metrics.ps_merger.PSMerger: the parameter servers' dense tables, raw bits).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from recps.metrics import funnel as fm
from recps.metrics.collection import MetricCollection
from recps.metrics.grouped import GroupedAUC
from recps.pipeline.data import Csr
from recps.pipeline.ease import fit_ease
from recps.pipeline.funnel import Funnel
from recps.pipeline.sasrec_alone import fit_sasrec
from recps.pipeline.stages import EvalSettings

__all__ = ["evaluate_funnel", "hits", "ideal_keep", "most_popular", "LISTS", "verdicts"]

log = logging.getLogger("recps.pipeline")
PROGRESS_S = 10.0  # at most this long between the progress lines of an evaluation

LISTS = ("final", "most_popular", "recall_alone", "without", "ideal", "ease", "sasrec")  # the lists every request's metrics cover




def hits(lists: torch.Tensor, positives: Csr, num_items: int) -> torch.Tensor:
    """(B, K) bool: whether item lists[b, k] is a positive of row b of `positives` (-1 pads never are)."""
    b = lists.shape[0]
    rows = torch.arange(b).unsqueeze(1)
    keys = torch.where(lists >= 0, rows * num_items + lists, torch.full_like(lists, -1))  # (B, K)
    wanted = positives.row_ids() * num_items + positives.items  # (P,)
    return torch.isin(keys, wanted)


def ideal_keep(data, users: torch.Tensor, received: torch.Tensor, keep: int) -> torch.Tensor:
    """(B, k) the `keep` items of `received` (B, K) (-1 pads) of highest true P(click) (data.click_prob, as of the
    held-out request), -1 padded: what a ranker that knew the world's label model would keep of that input."""
    valid = received >= 0
    p = torch.full(received.shape, -torch.inf, dtype=torch.float64)
    p[valid] = data.click_prob(users.unsqueeze(1).expand_as(received)[valid], received[valid]).to(torch.float64)
    top = torch.topk(p, min(keep, received.shape[1]), dim=1)  # (B, k)
    kept = received.gather(1, top.indices)
    return torch.where(torch.isfinite(top.values), kept, torch.full_like(kept, -1))


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


def _list_names(name: str, n: int, utility: bool, logged: bool) -> list[str]:
    names = [f"{name}.ndcg@{n}", f"{name}.hr@{n}", f"{name}.recall@{n}"]
    if utility:
        names.append(f"{name}.utility_ndcg@{n}")
    if logged:
        names += [f"{name}.logged_ndcg@{n}", f"{name}.logged_hr@{n}", f"{name}.logged_recall@{n}"]
    return names


def _list_pairs(name: str, lists: torch.Tensor, n: int, positives: Csr, logged: Csr | None,
                utility: torch.Tensor | None) -> dict[str, torch.Tensor]:
    top = lists[:, :n]
    out = {**fm.ndcg_at_k(top, positives.offsets, positives.items, n, f"{name}.ndcg@{n}"),
           **fm.hit_rate(top, positives.offsets, positives.items, n, f"{name}.hr@{n}"),
           **fm.recall_at_k(top, positives.offsets, positives.items, n, f"{name}.recall@{n}")}
    if utility is not None:
        out[f"{name}.utility_ndcg@{n}"] = torch.stack([utility.to(torch.float64).sum(),
                                                      torch.tensor(float(lists.shape[0]), dtype=torch.float64)])
    if logged is not None:
        out.update({**fm.ndcg_at_k(top, logged.offsets, logged.items, n, f"{name}.logged_ndcg@{n}"),
                    **fm.hit_rate(top, logged.offsets, logged.items, n, f"{name}.logged_hr@{n}"),
                    **fm.recall_at_k(top, logged.offsets, logged.items, n, f"{name}.logged_recall@{n}")})
    return out


def verdicts(funnel_metrics: dict[str, float], baselines: dict[str, dict[str, float]], n: int) -> list[str]:
    """One line per baseline: whether the funnel's ndcg@n beat it."""
    key = f"ndcg@{n}"
    mine = funnel_metrics.get(key)
    out = []
    for name, row in baselines.items():
        theirs = row.get(key)
        if mine is None or theirs is None:
            continue
        out.append(f"funnel beats {name}: {'yes' if mine > theirs else 'no'} ({mine:.4f} vs {theirs:.4f} {key})")
    return out


def evaluate_funnel(funnel: Funnel, settings: EvalSettings, merger: Any = None, worker: int = 0,
                    workers: int = 1) -> dict[str, Any]:
    """The metrics of the module docstring on the held-out requests of funnel.data: this worker's share
    (requests worker, worker + workers, ...), merged with the others' through `merger` (every worker calls
    this, a collective; None: one worker). Every worker returns the merged metrics; `final_lists` holds
    this worker's requests' final lists."""
    data = funnel.data
    n = settings.top_n
    specs = funnel.specs
    first, final = specs[0], specs[-1]
    requests = torch.arange(data.test_users.numel())
    if settings.eval_users > 0:
        requests = requests[: settings.eval_users]
    total_requests = int(requests.numel())
    requests = requests[worker::workers]
    batch = settings.eval_batch_users
    skip = specs[1].name if len(specs) > 2 else None  # coarse: the baseline without it
    after_skip = specs[2].name if skip else None
    has_utility = data.utility_ndcg is not None
    logged_csr = data.logged_positives
    ease_fit, sasrec = settings.ease, settings.sasrec
    lists = [name for name in LISTS if (name != "without" or skip) and (name != "ideal" or data.ideal is not None)
             and (name != "ease" or ease_fit is not None) and (name != "sasrec" or sasrec is not None)]
    names = ["positives", *(f"{s.name}.{m}" for s in specs for m in ("pass_through", "chance")),
             f"{first.name}.recall@{first.keep}", f"{first.name}.ndcg@{first.keep}", f"{first.name}.hr@{first.keep}",
             *(f"{s.name}.{m}" for s in specs[1:] for m in ("gauc", "pnr")),
             *(m for name in lists for m in _list_names(name, n, has_utility, logged_csr is not None)),
             "hit_rate", *(f"seconds.{s.name}" for s in specs)]
    if data.click_prob is not None:
        names += [f"{s.name}.ideal_pass_through" for s in specs[1:]]
    if skip:
        names.append("agreement")
    tally = fm.FunnelTally(names, name="funnel")
    aucs = MetricCollection([GroupedAUC(name=f"{s.name}.auc") for s in specs[1:]]) if len(specs) > 1 else None
    final_kept: list[torch.Tensor] = []  # the final lists, request by request (recommend is checked against them)
    start = time.perf_counter()
    said, done = start, 0
    for part in requests.split(batch):
        if (now := time.perf_counter()) - said >= PROGRESS_S:  # a long evaluation says how far it is
            log.info("funnel evaluation: %d of this worker's %d requests in %.0f s", done,
                     requests.numel(), now - start)
            said = now
        done += part.numel()
        users = data.test_users[part]
        positives = data.test_positives.rows(part)
        po, pi = positives.offsets, positives.items
        logged = logged_csr.rows(part) if logged_csr is not None else None
        shown = data.test_shown.rows(part) if data.test_shown is not None else None
        out = funnel.run(users, record_inputs=True)
        npos = float(pi.numel())
        tally.add({"positives": torch.tensor([npos, float(users.numel())], dtype=torch.float64)})  # (sum, requests)
        for s in specs:
            tally.add({f"seconds.{s.name}": torch.tensor([out.seconds[s.name], float(users.numel())],
                                                         dtype=torch.float64)})
            kept = out.kept[s.name]
            received = None if s.upstream is None else out.kept[s.upstream]  # what reached the stage
            pool = None if received is not None else data.num_items - data.seen.rows(users).offsets.diff()  # (B,)
            tally.add(fm.pass_through(received, kept, po, pi, f"{s.name}.pass_through", f"{s.name}.chance", pool))
            if s.upstream is not None:
                cands = out.inputs[s.name]  # (B, K_in) what the ranker received
                if shown is not None:  # only what the held-out requests showed has a label
                    cands = torch.where(hits(cands, shown, data.num_items), cands, torch.full_like(cands, -1))
                scores = out.input_scores[s.name].nan_to_num(neginf=-1e30)
                tally.add(fm.ranker_counts(cands, scores, po, pi, prefix=f"{s.name}."))
                valid = cands >= 0
                labels = hits(cands, positives, data.num_items)[valid].to(torch.float32)
                aucs[f"{s.name}.auc"].update(scores[valid], labels, torch.zeros(int(valid.sum()), dtype=torch.int64))
                if data.click_prob is not None:
                    tally.add(fm.pass_through(received, ideal_keep(data, users, received, s.keep), po, pi,
                                              f"{s.name}.ideal_pass_through"))
        recall_kept = out.kept[first.name]
        k = first.keep
        tally.add({**fm.recall_at_k(recall_kept, po, pi, k, f"{first.name}.recall@{k}"),
                   **fm.ndcg_at_k(recall_kept, po, pi, k, f"{first.name}.ndcg@{k}"),
                   **fm.hit_rate(recall_kept, po, pi, k, f"{first.name}.hr@{k}")})
        top = out.kept[final.name]
        final_kept.append(top)
        tally.add({"hit_rate": torch.stack([fm.hits(top, po, pi).sum().to(torch.float64),
                                            torch.tensor(npos, dtype=torch.float64)])})
        shown_lists = {"final": top, "recall_alone": recall_kept[:, :n], "most_popular": most_popular(funnel, users, n)}
        if skip:
            without = funnel.run(users, skip={skip})
            shown_lists["without"] = without.kept[final.name]
            tally.add(fm.agreement(out.kept[skip], without.kept[after_skip], specs[2].keep, "agreement"))
        if data.ideal is not None:
            shown_lists["ideal"] = data.ideal(users, n, data.seen.rows(users))
        for name, lst in shown_lists.items():
            utility = data.utility_ndcg(users, lst[:, :n]) if has_utility else None
            tally.add(_list_pairs(name, lst, n, positives, logged, utility))
    fitted: dict[str, Any] = {}  # the full-catalogue baselines, fitted once per run: worker 0 scores every request
    info: dict[str, dict[str, Any]] = {}
    if ease_fit is not None and worker == 0:
        # the funnel's item_cf is this very fit (pipeline.baselines.ease's settings, the same training rows)
        ease = fitted["ease"] = funnel.item_cf if funnel.item_cf is not None else fit_ease(data, ease_fit, n)
        info["ease"] = {"l2": ease.l2, "validation_ndcg@" + str(n): {str(k): v for k, v in ease.validation.items()},
                        "items": int(ease.items.numel()), "fit_seconds": ease.seconds,
                        "interactions": ease_fit["interactions"], "validation_fraction": ease_fit["validation_fraction"]}
    if sasrec is not None and worker == 0:
        model = fitted["sasrec"] = fit_sasrec(data, sasrec, n)
        info["sasrec"] = {"epochs": model.epochs, "validation_ndcg@" + str(n): {str(k): v for k, v in
                                                                                 model.validation.items()},
                          "fit_seconds": model.seconds, "interactions": sasrec["interactions"],
                          "validation_fraction": sasrec["validation_fraction"]}
    for name, model in fitted.items():
        for part in torch.arange(total_requests).split(batch):
            users = data.test_users[part]
            positives = data.test_positives.rows(part)
            logged = logged_csr.rows(part) if logged_csr is not None else None
            lst = model.lists(data, users, n)
            utility = data.utility_ndcg(users, lst[:, :n]) if has_utility else None
            tally.add(_list_pairs(name, lst, n, positives, logged, utility))
    wall = time.perf_counter() - start
    if merger is not None:
        tally = fm.merge_tally(tally, merger)
        if aucs is not None:
            aucs = merger.merge(aucs)
    v = tally.values()
    state = tally.state()
    num = lambda key: float(state[key][0])  # noqa: E731
    stages: dict[str, dict[str, Any]] = {}
    for s in specs:
        survived, reached = (float(x) for x in state[f"{s.name}.pass_through"])
        low, high = fm.wilson_interval(survived, reached)
        row: dict[str, Any] = {"keep": s.keep, "pass_through": v[f"{s.name}.pass_through"], "pass_through_low95": low,
                               "pass_through_high95": high, "chance": v[f"{s.name}.chance"], "hits": survived}
        if s.upstream is None:
            row.update({f"{m}@{s.keep}": v[f"{s.name}.{m}@{s.keep}"] for m in ("recall", "ndcg", "hr")})
        else:
            row.update(auc=aucs[f"{s.name}.auc"].compute(), gauc=v[f"{s.name}.gauc"], pnr=v[f"{s.name}.pnr"])
            if data.click_prob is not None:
                row["ideal_pass_through"] = v[f"{s.name}.ideal_pass_through"]
        stages[s.name] = row

    def list_metrics(name: str) -> dict[str, float]:
        prefix = f"{name}."
        return {key[len(prefix):]: value for key, value in v.items() if key.startswith(prefix)}

    funnel_metrics: dict[str, Any] = list_metrics("final")
    funnel_metrics["hit_rate"] = v["hit_rate"]
    if skip:
        funnel_metrics["agreement"] = v["agreement"]
    baselines = {("recall_without_" + skip if name == "without" else name): list_metrics(name)
                 for name in lists if name != "final"}
    users_n = int(round(float(state["positives"][1])))
    seconds = {s.name: num(f"seconds.{s.name}") for s in specs}
    latency = {s.name: 1000.0 * v[f"seconds.{s.name}"] for s in specs}
    return {"stages": stages, "funnel": funnel_metrics, "baselines": baselines, "requests": users_n, **info,
            "verdicts": verdicts(funnel_metrics, baselines, n),
            "requests_asked": total_requests, "requests_held_out": int(data.test_users.numel()),
            "positives": num("positives"), "eval_seconds": wall,
            "evaluated_on": data.evaluated_on, "latency_ms_per_user": latency,
            "users_per_sec": users_n / max(1e-9, sum(seconds.values())),
            "final_lists": {"users": data.test_users[requests].tolist(),
                            "items": (torch.cat(final_kept) if final_kept else torch.zeros(0, n)).tolist()}}
