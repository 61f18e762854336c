"""The funnel (issue 16): bad input fails before any process starts; per-stage modes follow their own rules on
one set of servers; the whole funnel trains end to end on a small generated world through the real CLI
(recall GEO, coarse and fine async, fusion sync), beats most-popular and recall alone on the held-out
random-bucket clicks, its evaluation split over two workers merges through the servers to the one-worker
metrics, and `recps.pipeline.recommend` serves the same lists as the evaluation."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recps.config import compose_config
from recps.errors import ConfigError
from tests.helpers.cli import recps_train, run_module

# A small world and funnel: 600 users x 60 impressions, 2,000 items; keep 200 -> 50 -> 20 -> 10; the held-out
# random bucket: 500 items per user. (Training takes ~15 s of the run: 600 x 30 impressions left every ranker
# near chance on the bucket, FM-like models too.)
SMALL = [
    "pipeline=video_funnel",
    "pipeline.world.users=600", "pipeline.world.items=2000", "pipeline.world.creators=200",
    "pipeline.world.metric_users=100", "pipeline.world.impressions_per_user=60",
    "pipeline.world.random_items_per_user=500",
    # the world before issue 29.4 (no short-term interest, no age x category cross): the bounds below were
    # measured on it; the stages do not read the history yet
    "pipeline.world.short_term_weight=0", "pipeline.world.cross_scale=0",
    "pipeline.stages.recall.keep=200", "pipeline.stages.coarse.keep=50", "pipeline.stages.fine.keep=20",
    "pipeline.stages.coarse.inputs.candidates_per_user=30", "pipeline.stages.fine.inputs.candidates_per_user=20",
    "pipeline.stages.fusion.inputs.candidates_per_user=10",
    "pipeline.eval_users=0", "pipeline.eval_batch_users=128",
    *(f"pipeline.stages.{s}.trainer.batch_size=256" for s in ("recall", "coarse", "fine", "fusion")),
    *(f"pipeline.stages.{s}.inputs.candidate_users=0" for s in ("coarse", "fine", "fusion")),
    "pipeline.stages.recall.trainer.epochs=10", "pipeline.stages.coarse.trainer.epochs=3",
    "pipeline.stages.fine.trainer.epochs=5", "pipeline.stages.fusion.trainer.epochs=3",
]


def _cfg(*extra: str):
    return compose_config([*SMALL, *extra])


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("override, stage_key, fix", [
    (["pipeline.stages.coarse.model._target_=models.NoSuchModel"], "pipeline.stages.coarse.model._target_",
     "fix the name"),
    (["pipeline.stages.fine.inputs.upstream=ranker"], "pipeline.stages.fine.inputs.upstream='ranker'",
     "name the stage whose candidates it scores"),
    (["pipeline.stages.coarse.keep=500"], "pipeline.stages.coarse.keep=500 is larger than its input",
     "lower pipeline.stages.coarse.keep"),
    (["pipeline.stages.recall.model.query_features=[user_id,gender]"], "pipeline.stages.recall.model.query_features",
     "add them there"),
    (["ps@pipeline.stages.fusion.ps=local"], "pipeline.stages.fusion.ps.name='local'",
     "ps@pipeline.stages.fusion.ps=sync|async|geo"),
    (["pipeline.stages.recall.model._target_=models.DeepFM"],
     "pipeline.stages.recall.model._target_=models.DeepFM has no encode()", "use a two-tower model"),
    (["pipeline.stages.fine.score_weights=[1.0]"], "pipeline.stages.fine.score_weights", "one weight per objective"),
    # inputs.share: one table has one width; the owner is an earlier stage that has the feature
    (["pipeline.stages.coarse.inputs.share={item_id:recall}"], "pipeline.stages.coarse.inputs.share.item_id=recall",
     "set pipeline.stages.coarse.model.embedding_dim=16"),
    (["pipeline.stages.coarse.inputs.share={item_id:ranker}"], "pipeline.stages.coarse.inputs.share.item_id=ranker",
     "a stage shares the table of a stage trained before it"),
    (["pipeline.stages.coarse.inputs.share={item_id:fine}"], "'fine' is a later stage", "name one of them"),
    (["pipeline.stages.recall.model.candidate_features=[item_id,category,creator,duration]",
      "pipeline.stages.recall.inputs.features=[user_id,age,region,activity,item_id,category,creator,duration]",
      "pipeline.stages.coarse.model.embedding_dim=16", "pipeline.stages.coarse.inputs.share={exposures:recall}"],
     "stage recall has no 'exposures' table", "share a feature it trains"),
    (["++pipeline.stages.fusion.inputs.score_norm=rank"], "pipeline.stages.fusion.inputs.score_norm='rank'",
     "use one of ['none', 'request']"),
])
def test_bad_stage_config_fails_before_any_process_starts(tmp_path, override, stage_key, fix):
    from recps.pipeline import run_pipeline

    with pytest.raises(ConfigError) as info:
        run_pipeline(_cfg(*override), tmp_path)
    message = str(info.value)
    assert stage_key in message and fix in message, message
    assert not any(tmp_path.iterdir()), "nothing may be written (no process started) before the config is checked"


def test_features_the_data_lacks_fail_in_the_launcher_before_any_process(tmp_path):
    """inputs.features naming a feature the world does not have: checked against the loaded data by the
    launcher (before_launch), before any server or worker starts."""
    from recps.pipeline import run_pipeline

    cfg = _cfg("pipeline.stages.fine.inputs.features=[user_id,item_id,watch_time]",
               f"pipeline.world.dir={tmp_path / 'world'}")
    with pytest.raises(ConfigError) as info:
        run_pipeline(cfg, tmp_path / "run")
    message = str(info.value)
    assert "pipeline.stages.fine.inputs.features" in message and "watch_time" in message, message
    assert not (tmp_path / "run" / "cluster.log").exists() and not (tmp_path / "run" / "recps-job.yaml").exists()


# ------------------------------------------------------------------- modes, one set of servers


def _quartic(rows: torch.Tensor, target: float) -> torch.Tensor:
    return ((rows - target) ** 4).sum() / 4  # gradient (x - t)^3: the modes' results differ


def test_each_stage_is_updated_by_its_own_modes_rule_on_one_server():
    """Three stages' collections (as the runner registers them: prefix = stage, the stage's own mode object)
    against ONE server, two workers on threads, SGD rows starting at 0, loss (x - t_w)^4 / 4 on one key:
    the recall table (GEO, k_steps large) holds 0 + the mean of each worker's local SGD; coarse (async)
    took every worker's push as it came (between the sync-of-the-mean and the local results); fusion
    (sync) one SGD step on the mean gradient per step. The servers tag each table with its stage's mode."""
    from recps.cluster.launch import free_port
    from recps.pipeline.stages import pipeline_specs
    from recps.pipeline.funnel import stage_collection
    from recps.ps.embedding import salted_keys
    from recps.ps.fleet import DistributedStrategy, Fleet
    from recps.ps.roles import UserDefinedRoleMaker

    lr, steps, targets = 0.1, 4, (1.0, 3.0)
    table = ["optimizer.name=sgd", f"optimizer.lr={lr}", "init_std=0.0"]
    overrides = [f"pipeline.stages.{s}.ps.table.{t}" for s in ("recall", "coarse", "fusion") for t in table]
    overrides += ["pipeline.stages.recall.ps.k_steps=1000", "pipeline.stages.recall.ps.background_sync=false",
                  "pipeline.stages.recall.ps.table.optimizer.name=sgd", "pipeline.stages.recall.ps.local_init=false"]
    cfg = _cfg(*overrides)
    address = f"127.0.0.1:{free_port()}"
    role = lambda kind, i: UserDefinedRoleMaker(kind, i, 1, 2, coordinator=address, token="t").role()  # noqa: E731
    results, errors = {}, []

    def work(w: int) -> None:
        try:
            specs = {s.name: s for s in pipeline_specs(cfg)}  # each worker its own mode objects
            chosen = [specs[n] for n in ("recall", "coarse", "fusion")]
            with Fleet(role("worker", w), connect_timeout_s=30) as fleet:
                collections = {}
                for s in chosen:
                    collections[s.name] = stage_collection(s)
                    fleet.add_collection(collections[s.name], mode=s.mode)
                fleet.init_worker(DistributedStrategy(mode=chosen[0].mode, threads=1))
                for s in chosen:
                    ebc = collections[s.name]
                    kjt = KeyedJaggedTensor.from_lengths_sync(  # key 0 of the stage's first feature, one row
                        keys=list(s.features), values=torch.zeros(1, dtype=torch.int64),
                        lengths=torch.tensor([1] + [0] * (len(s.features) - 1)))
                    for i in range(steps):
                        rows = ebc(kjt).values()[:, : int(s.model.embedding_dim)]  # its row (1, D)
                        if i == 0 and s.mode.name == "geo":  # both replicas pulled the row at 0 before either
                            fleet.client.barrier(f"test.{s.name}.pulled", timeout=30)  # synced (CI: one ran late)
                        _quartic(rows, targets[w]).backward()
                        ebc.communicator.step_end(0)
                    ebc.communicator.close()
                    fleet.client.barrier(f"test.{s.name}", timeout=30)
                key = lambda s: salted_keys(torch.zeros(1, dtype=torch.int64), f"t_{s.features[0]}")  # noqa: E731
                results[w] = {s.name: fleet.client.pull(f"{s.name}_d{int(s.model.embedding_dim)}", key(s),
                                                        create=False).wait(30)[0, 0].item() for s in chosen}
                results[w]["modes"] = {s.name: fleet.client.table_spec(f"{s.name}_d{int(s.model.embedding_dim)}")["mode"]
                                       for s in chosen}
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with Fleet(role("server", 0), connect_timeout_s=30) as server:
        server.init_server()
        threads = [threading.Thread(target=work, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        server.run_server()
        for t in threads:
            t.join(60)
    assert not errors, errors

    def sgd(x: float, grad) -> float:
        for _ in range(steps):
            x = x - lr * grad(x)
        return x

    g = lambda x, t: (x - t) ** 3  # noqa: E731
    local = [sgd(0.0, lambda x, t=t: g(x, t)) for t in targets]  # each worker alone
    geo = sum(local) / 2  # the server adds each worker's delta, scaled 1/W
    sync = sgd(0.0, lambda x: (g(x, targets[0]) + g(x, targets[1])) / 2)
    assert results[0]["modes"] == {"recall": "geo", "coarse": "async", "fusion": "sync"}
    for w in (0, 1):
        assert results[w]["recall"] == pytest.approx(geo, rel=1e-5)
        assert results[w]["fusion"] == pytest.approx(sync, rel=1e-5)
    assert abs(geo - sync) > 0.01  # the rules give different values here
    # async: 2 x steps pushes applied one by one, each at the value its worker last pulled: neither rule above
    assert results[0]["coarse"] == results[1]["coarse"]
    assert abs(results[0]["coarse"] - sync) > 1e-3 and abs(results[0]["coarse"] - geo) > 1e-3


# ------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def funnel_run(tmp_path_factory):
    """`python -m recps.train pipeline=video_funnel` (small) through the CLI: 1 server, 1 worker."""
    root = tmp_path_factory.mktemp("funnel")
    run = root / "run"
    proc = recps_train(*SMALL, f"pipeline.world.dir={root / 'world'}", f"hydra.run.dir={run}", timeout=600)
    return run, proc.metrics(), proc.stdout


@pytest.mark.e2e
def test_funnel_trains_end_to_end_each_stage_in_its_mode(funnel_run):
    run, metrics, stdout = funnel_run
    modes = {"recall": "geo", "coarse": "async", "fine": "async", "fusion": "sync"}
    # On the servers: every table of a stage (its sparse tables and its dense table) tagged with its mode.
    for stage, tables in metrics["server_tables"].items():
        assert set(tables.values()) == {modes[stage]}, (stage, tables)
        assert f"{stage}_dense" in tables and any(t.startswith(f"{stage}_d") for t in tables)
    assert metrics["stage_order"] == ["recall", "coarse", "fine", "fusion"]
    for stage, mode in modes.items():
        assert metrics["stages_trained"][stage]["mode"] == mode and metrics["stages_trained"][stage]["steps"] > 0
        assert f"stage {stage} ({mode}, keep" in stdout
    assert "funnel (" in stdout and "baseline most_popular" in stdout
    for name in ("recall", "coarse", "fine", "fusion"):
        assert (run / "funnel" / f"{name}.pt").is_file()
    assert (run / "funnel" / "items.ann").is_file()


@pytest.mark.e2e
def test_funnel_beats_most_popular_against_the_worlds_truth_and_each_stage_passes_positives(funnel_run):
    """Held-out positives: each user's random-bucket clicks (items shown uniformly at random; see
    datasets/video_world.md); the logged test clicks are reported beside them. Bounds, with the values
    measured in two runs beside them (this world, seed 0; async training varies a little run to run)."""
    _, metrics, _ = funnel_run
    funnel, base, stages = metrics["funnel"], metrics["baselines"], metrics["stages"]
    assert metrics["evaluated_on"] == "random_bucket" and metrics["requests"] == 600
    # The bounded measure against the ideal funnel (the world's true utility of the list, DCG over the
    # ideal list's): measured 0.522-0.528 against most-popular's 0.309. Stated margin: 30%.
    assert funnel["utility_ndcg@10"] >= 1.30 * base["most_popular"]["utility_ndcg@10"], (funnel, base)
    assert base["ideal"]["utility_ndcg@10"] == pytest.approx(1.0)
    # On the random bucket the ideal list is the best (0.194) and most-popular is not (0.081); on the logged
    # clicks most-popular beats the ideal (0.055 > 0.045): why the funnel is evaluated on the bucket.
    assert base["ideal"]["ndcg@10"] > funnel["ndcg@10"] > base["most_popular"]["ndcg@10"]
    assert base["most_popular"]["logged_ndcg@10"] > base["ideal"]["logged_ndcg@10"]
    # Coarse costs no quality (fine over all of recall's 200 candidates: 0.114-0.116 against the funnel's 0.126)
    # and cuts fine's pairs 4x.
    assert funnel["ndcg@10"] >= 0.97 * base["recall_without_coarse"]["ndcg@10"], (funnel, base)
    # Pass-through bounds: a stage keeping a share of what it received keeps a larger share of the positives
    # that reached it (chance: the share it keeps) and not all of them.
    assert 200 / 2000 * 1.8 <= stages["recall"]["pass_through"] <= 0.6  # measured 0.237
    assert 50 / 200 * 1.15 <= stages["coarse"]["pass_through"] <= 0.8  # measured 0.322 (two runs)
    assert 20 / 50 * 1.05 <= stages["fine"]["pass_through"] <= 0.9  # measured 0.454-0.463
    # fusion reorders fine's 20 near chance on the bucket (GAUC 0.545-0.558): at least 95% of its keep share
    assert 10 / 20 * 0.95 <= stages["fusion"]["pass_through"] <= 0.9  # measured 0.524-0.536
    assert stages["coarse"]["gauc"] > 0.57 and stages["coarse"]["pnr"] > 1.4  # measured 0.607, 1.61 (two runs)
    assert stages["fine"]["gauc"] > 0.55 and stages["fine"]["pnr"] > 1.2  # measured 0.595-0.601, 1.48-1.51
    assert 0.0 < funnel["agreement"] <= 1.0


@pytest.mark.e2e
def test_final_ndcg_beats_most_popular_and_recall_alone(funnel_run):
    """Issue 16's test: the final list's NDCG@10 on the held-out random-bucket clicks beats most-popular's by
    30% and recall alone's (its top 10) by 5% (measured 0.126 in two runs against 0.081 and 0.107: 1.55x and
    1.18x). The logged-policy NDCG@10 is reported too (measured 0.030 against 0.055 and 0.059)."""
    _, metrics, _ = funnel_run
    funnel, base = metrics["funnel"], metrics["baselines"]
    assert funnel["ndcg@10"] >= 1.30 * base["most_popular"]["ndcg@10"], (funnel, base)
    assert funnel["ndcg@10"] >= 1.05 * base["recall_alone"]["ndcg@10"], (funnel, base)
    assert funnel["hr@10"] > base["recall_alone"]["hr@10"] > base["most_popular"]["hr@10"]
    assert 0.0 < funnel["logged_ndcg@10"] < 1.0 and "logged_hr@10" in base["most_popular"]


@pytest.mark.e2e
def test_recommend_returns_the_evaluation_paths_lists(funnel_run):
    from recps.pipeline.recommend import load_funnel, recommend

    run, _, _ = funnel_run
    saved = json.loads((run / "funnel" / "final_lists.json").read_text())
    users = saved["users"][:50]
    funnel = load_funnel(run)  # no cluster: the exports and the index from the run folder
    served = recommend(funnel, torch.tensor(users))
    for row, expected in zip(served, saved["items"][:50]):
        assert row["items"] == [i for i in expected if i >= 0]
        assert set(row["scores"]) == {"recall", "coarse", "fine", "fusion"}
        fusion = row["scores"]["fusion"]
        assert fusion == sorted(fusion, reverse=True)  # best first
    proc = run_module("recps.pipeline.recommend", str(run), "--users", ",".join(str(u) for u in users[:3]),
                      "--latency-users", "20", timeout=300)
    lines = proc.stdout.splitlines()
    # what each stage's scores are (fine ranks by click + 0.5 x long view: not a probability), then the lists
    assert lines[0] == ("scores: recall P(click); coarse P(click); fine 1 x P(click) + 0.5 x P(long_view); "
                        "fusion P(click)"), proc.stdout
    assert lines[1] == f"user {users[0]}: " + " ".join(str(i) for i in served[0]["items"])
    assert "p99" in proc.stdout and "users/s" in proc.stdout
    assert "is_fx_tracing" not in proc.output, proc.stderr[-2000:]  # as quiet as recps.train (issue 32.4)


@pytest.mark.e2e
def test_recommend_takes_n_says_what_it_does_not_do_and_measures_latency_only_when_asked(funnel_run, tmp_path, capsys):
    """Issue 32.5: `--n 5` was advertised and refused; the latency probe ran unasked; a pipeline=none run folder
    got a message about missing stages."""
    from omegaconf import OmegaConf

    from recps.pipeline.recommend import main

    run, _, _ = funnel_run
    saved = json.loads((run / "funnel" / "final_lists.json").read_text())
    user = saved["users"][0]
    assert main([str(run), "--users", str(user), "--n", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"user {user}: " + " ".join(str(i) for i in saved["items"][0][:5]), out
    assert not any("latency" in line for line in out), out  # only with --latency-users N
    for n in ("0", "11"):
        assert main([str(run), "--users", str(user), "--n", n]) == 1
        assert capsys.readouterr().err.strip() == (f"recommend: ConfigError: --n {n}: give a list length from 1 to 10 "
                                                   "(what the final stage fusion keeps, "
                                                   "pipeline.stages.fusion.keep)")
    plain = tmp_path / "plain"
    plain.mkdir()
    OmegaConf.save(compose_config(["ps=local"]), plain / "recps-job.yaml")  # a single model's run folder
    assert main([str(plain), "--users", "0"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"recommend: ConfigError: {plain}: not a funnel run (pipeline=none); give the folder of a `python -m "
        "recps.train pipeline=...` run (a single model's run is served by recps.serve)")


@pytest.mark.e2e
def test_evaluation_split_over_two_workers_merges_through_the_servers_to_the_one_worker_metrics(funnel_run,
                                                                                                monkeypatch, caplog):
    """The trained funnel evaluated by one process, and by two workers (each its share of the held-out
    requests) whose tallies and AUC columns merge through a real server: the same metrics. A long evaluation
    logs how far it is (issue 32.6: 35 s without a line): here every batch, PROGRESS_S set to 0."""
    import logging

    from omegaconf import OmegaConf

    from recps.metrics.ps_merger import PSMerger
    from recps.pipeline import held_out
    from recps.pipeline.held_out import evaluate_funnel
    from recps.pipeline.stages import eval_settings
    from recps.pipeline.recommend import load_funnel
    from tests.helpers.cluster import servers_and_workers

    run, _, _ = funnel_run
    cfg = OmegaConf.load(run / "recps-job.yaml")
    cfg.pipeline.eval_users = 64  # 32 requests each, in batches of 16: several rounds
    cfg.pipeline.eval_batch_users = 16
    funnel = load_funnel(run)  # read-only once built: both worker threads score with it (faiss search is too)
    settings = eval_settings(cfg)
    monkeypatch.setattr(held_out, "PROGRESS_S", 0.0)
    with caplog.at_level(logging.INFO, logger="recps.pipeline"):
        one = evaluate_funnel(funnel, settings)
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("funnel evaluation: ")]
    assert [m.split(" in ")[0] for m in progress] == [f"funnel evaluation: {d} of this worker's 64 held-out requests"
                                                      for d in (0, 16, 32, 48)], progress
    got: dict[int, dict] = {}

    def work(rank: int, client) -> None:
        got[rank] = evaluate_funnel(funnel, settings, merger=PSMerger(client, prefix="test.eval"), worker=rank,
                                    workers=2)

    servers_and_workers(work)
    assert got[0]["requests"] == got[1]["requests"] == one["requests"] == 64
    assert got[0]["final_lists"]["users"] == one["final_lists"]["users"][0::2]
    def flat(metrics: dict) -> dict:
        out = {}
        for key in ("stages", "funnel", "baselines"):
            for name, row in metrics[key].items():
                for k, v in (row.items() if isinstance(row, dict) else [("", row)]):
                    out[f"{key}.{name}.{k}"] = v
        out["positives"] = metrics["positives"]
        return out

    assert flat(got[0]) == pytest.approx(flat(got[1]), rel=0, abs=0, nan_ok=True)  # both hold the merged values
    assert flat(got[0]) == pytest.approx(flat(one), rel=1e-9, abs=1e-12, nan_ok=True)
    assert len(flat(one)) > 40 and one["stages"]["fine"]["auc"] > 0.5


# ------------------------------------------------------------------------------- the pieces


def test_summary_prints_counts_as_integers_and_rates_to_four_places():
    """Issue 32.7: `hits=48395.0000`, `42932.7905 ex/s`."""
    from recps.pipeline.runner import summary_lines

    metrics = {"stage_order": ["fine"], "stages": {"fine": {"keep": 100, "auc": 0.8322, "hits": 48395.0,
                                                            "pass_through": 0.25, "gauc": 1.0}},
               "stages_trained": {"fine": {"mode": "async", "steps": 58, "examples": 29000,
                                           "examples_per_sec": 42932.7905}},
               "funnel": {"ndcg@10": 0.1617}, "requests": 500, "baselines": {}}
    assert summary_lines(metrics)[:2] == [
        "stage fine (async, keep 100): auc=0.8322 hits=48395 pass_through=0.2500 gauc=1.0000 | trained 58 steps, "
        "29000 examples, 42,933 ex/s",
        "funnel (500 held-out requests): ndcg@10=0.1617"]


def test_hits_and_csr_rows_match_a_loop():
    from recps.pipeline.data import csr_from_pairs
    from recps.pipeline.held_out import hits

    g = torch.Generator().manual_seed(0)
    rows, items = torch.randint(0, 6, (40,), generator=g), torch.randint(0, 30, (40,), generator=g)
    csr = csr_from_pairs(rows, items, 6)
    pick = torch.tensor([4, 0, 4, 2])
    part = csr.rows(pick)
    for r, row in enumerate(pick.tolist()):
        assert part.items[part.offsets[r]:part.offsets[r + 1]].tolist() == sorted(set(items[rows == row].tolist()))
    lists = torch.randint(-1, 30, (4, 7), generator=g)
    got = hits(lists, part, 30)
    for r in range(4):
        wanted = set(part.items[part.offsets[r]:part.offsets[r + 1]].tolist())
        assert got[r].tolist() == [i >= 0 and i in wanted for i in lists[r].tolist()]


def test_per_request_standardises_each_column_over_a_users_rows():
    """score_norm=request: each score column over one request's candidates has mean 0 and sd 1, whatever the
    scale and offset an upstream's scores have (a refreshed stage, EASE on more history); a request with one
    candidate, or a constant column, reads 0."""
    from recps.pipeline.funnel import per_request

    g = torch.Generator().manual_seed(1)
    users = torch.tensor([7, 7, 7, 7, 2, 2, 2, 9])
    dense = torch.randn(8, 2, generator=g)
    dense[4:7, 1] = 3.0  # constant within user 2
    out = per_request(dense, users)
    for u in (7, 2):
        rows = out[users == u, 0]
        assert abs(float(rows.mean())) < 1e-6 and abs(float(rows.std(unbiased=False)) - 1.0) < 1e-5
    assert torch.equal(out[4:7, 1], torch.zeros(3)) and torch.equal(out[7], torch.zeros(2))
    shifted = per_request(dense * 5.0 + 2.0, users)  # the same ranker input after a scale and offset shift
    assert torch.allclose(shifted, out, atol=1e-5)


# A funnel whose coarse and fine are independent (fine ranks recall's candidates and reads recall's scores
# only): they may train in one group of pipeline.schedule, at the same time.
CONCURRENT = ["pipeline.schedule=[[recall],[coarse,fine],[fusion]]", "pipeline.stages.fine.inputs.upstream=recall",
              "pipeline.stages.fine.inputs.scores=[recall]"]
SHARE = ["pipeline.stages.coarse.model.embedding_dim=16", "pipeline.stages.coarse.inputs.share={item_id:recall}"]


def test_a_schedule_group_of_dependent_stages_fails_before_any_process_starts(tmp_path):
    from recps.pipeline import run_pipeline

    with pytest.raises(ConfigError) as info:  # the default fine ranks coarse's candidates
        run_pipeline(_cfg("pipeline.schedule=[[recall],[coarse,fine],[fusion]]"), tmp_path)
    message = str(info.value)
    assert ("stages fine and coarse are in one group ['coarse', 'fine'], but fine reads coarse's candidates "
            "(pipeline.stages.fine.inputs.upstream=coarse)") in message and "put fine in a group after" in message
    with pytest.raises(ConfigError, match=r"fine reads coarse's item_id table \(pipeline.stages.fine.inputs.share"):
        run_pipeline(_cfg(*CONCURRENT, "pipeline.stages.fine.inputs.share={item_id:coarse}"), tmp_path)  # a share too
    assert not any(tmp_path.iterdir())


@pytest.mark.e2e
def test_two_workers_train_every_stage_in_its_mode_sharing_a_table_and_two_stages_at_once(tmp_path):
    """cluster.workers=2 (a tiny world): each worker trains every stage on its share in the stage's mode
    (sync: the same steps on both), both build the same candidates from the same exports, worker 0
    evaluates while worker 1 waits at the last barrier. Two points of one run:
    - coarse shares recall's item_id table (inputs.share): one table on the servers, coarse's lookups return
      recall's rows and coarse's training (async) left them as recall (GEO) trained them (frozen);
    - coarse (async) and fine (sync) are independent and in one schedule group: both trained, in their own
      modes, at the same time (their training intervals overlap on each worker)."""
    from recps.ps.embedding import salted_keys

    run = tmp_path / "run"
    tiny = ["pipeline=video_funnel", "cluster.workers=2", "pipeline.world.users=150", "pipeline.world.items=1000",
            "pipeline.world.creators=100", "pipeline.world.metric_users=50", "pipeline.world.impressions_per_user=30",
            "pipeline.world.random_items_per_user=250", "pipeline.world.short_term_weight=0",
            "pipeline.world.cross_scale=0",
            "pipeline.stages.recall.keep=100", "pipeline.stages.coarse.keep=40", "pipeline.stages.fine.keep=20",
            *(f"pipeline.stages.{s}.trainer.epochs=1" for s in ("recall", "coarse", "fine", "fusion")),
            *SHARE, *CONCURRENT, "ps@pipeline.stages.fine.ps=sync",
            f"pipeline.world.dir={tmp_path / 'world'}", f"hydra.run.dir={run}"]
    metrics = recps_train(*tiny, timeout=600).metrics()
    assert metrics["workers"] == 2
    # coarse creates no item table: its item_id rows are recall's table, tagged geo (recall's rule)
    assert metrics["server_tables"] == {
        "recall": {"recall_d16": "geo", "recall_dense": "geo"}, "coarse": {"coarse_d16": "async", "coarse_dense": "async"},
        "fine": {"fine_d8": "sync", "fine_dense": "sync"}, "fusion": {"fusion_d1": "sync", "fusion_dense": "sync"}}
    assert metrics["shared_tables"] == {"coarse": {"item_id": "recall_d16"}}
    log = (run / "cluster.log").read_text()
    for worker in ("worker0", "worker1"):
        for stage, mode in (("recall", "geo"), ("coarse", "async"), ("fine", "sync"), ("fusion", "sync")):
            assert f"{worker}: stage {stage} trained in {mode} mode" in log
        assert f"{worker}: training stages coarse, fine concurrently" in log
    trained = metrics["stages_trained"]  # worker 0's wall clock
    assert all(trained[s]["steps"] > 0 for s in ("coarse", "fine"))
    assert trained["recall"]["finished"] <= min(trained[s]["started"] for s in ("coarse", "fine"))
    assert max(trained[s]["started"] for s in ("coarse", "fine")) < min(trained[s]["finished"] for s in ("coarse", "fine"))
    assert max(trained[s]["finished"] for s in ("coarse", "fine")) <= trained["fusion"]["started"]
    # The exports (what the servers held after each stage trained): coarse read every item's row from
    # recall_d16 and those rows are recall's, unchanged by coarse's training; coarse_d16 holds no item key.
    recall = torch.load(run / "funnel" / "recall.pt", weights_only=True)["tables"]
    coarse = torch.load(run / "funnel" / "coarse.pt", weights_only=True)["tables"]
    items = salted_keys(torch.arange(1000), "t_item_id")
    keys, rows = coarse["recall_d16"]
    assert torch.equal(torch.sort(keys).values, torch.sort(items).values)
    at = torch.searchsorted(recall["recall_d16"][0], keys)
    assert torch.equal(recall["recall_d16"][0][at], keys) and torch.equal(recall["recall_d16"][1][at], rows)
    assert float(rows.abs().sum()) > 0  # recall trained them
    assert not bool(torch.isin(coarse["coarse_d16"][0], items).any())
    assert metrics["requests"] > 0 and 0.0 <= metrics["funnel"]["ndcg@10"] <= 1.0
    # both workers evaluated their share of the requests; the merged tallies count them all
    assert "worker1: funnel evaluated" in log and metrics["requests"] == metrics["requests_asked"]


def test_a_history_stage_scores_pairs_in_chunks_its_positions_bound():
    """A stage reading behaviour history scores POSITIONS_PER_CALL // history_length pairs at a time (every pair
    holds up to history_length positions through the target attention: the baseline without coarse sends all of
    recall's candidates to fine at once); a stage without history PAIRS_PER_CALL; the scores are the unchunked
    ones, in order."""
    from types import SimpleNamespace

    from recps.pipeline import funnel as fn

    calls = []

    class Stage:
        def __init__(self, spec):
            self.spec = spec

        def outputs(self, data, users, items, dense=None, times=None):
            calls.append(int(users.numel()))
            return (items.to(torch.float32) / 1000.0).unsqueeze(1)  # (N, 1)

        def rank_score(self, probs):
            return probs[:, 0]

    data = SimpleNamespace(history_length=50)
    history = SimpleNamespace(name="fine", features=["user_id", "item_id", "history_item_id"], reads_dense=False)
    plain = SimpleNamespace(name="coarse", features=["user_id", "item_id"], reads_dense=False)
    assert fn.pairs_per_call(history, data) == fn.POSITIONS_PER_CALL // 50
    assert fn.pairs_per_call(plain, data) == fn.PAIRS_PER_CALL
    funnel = fn.Funnel([plain, history], {"coarse": Stage(plain), "fine": Stage(history)}, None, data)
    n = 2 * fn.pairs_per_call(history, data) + 7
    users, items = torch.zeros(n, dtype=torch.int64), torch.arange(n) % 1000
    probs, scores = funnel.score_pairs(history, users, items)
    assert calls == [n // 2 - 3, n // 2 - 3, 7]
    assert torch.equal(scores, items.to(torch.float32) / 1000.0) and probs.shape == (n, 1)
    calls.clear()
    funnel.score_pairs(plain, users, items)
    assert calls == [n]


def test_ideal_keep_ranks_a_stages_input_by_the_worlds_click_probability():
    """ideal_pass_through's list: the `keep` items of what a ranker received of highest true P(click) (here
    P(click) grows with the item id), -1 pads never kept; a request with fewer than `keep` real items pads."""
    from types import SimpleNamespace

    from recps.pipeline.held_out import ideal_keep

    data = SimpleNamespace(click_prob=lambda users, items: items.to(torch.float64) / 100.0 + users * 0.0)
    received = torch.tensor([[5, 40, -1, 7, 12], [3, -1, -1, -1, -1]])
    kept = ideal_keep(data, torch.tensor([0, 1]), received, 3)
    assert kept.tolist() == [[40, 12, 7], [3, -1, -1]]
