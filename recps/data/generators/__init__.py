"""Generated data sets with a known truth, for tests, benchmarks and the funnel.

    python -m recps.data.generators ctr --rows 100000 --out data/train.txt     # Criteo-like clicks
    python -m recps.data.generators drifting --days 2 --hours 4 --rows 20000 --out URL  # a time-partitioned stream
    python -m recps.data.generators video_world --out DIR                      # users, items, biased impressions

Modules: ctr (a planted logistic click model over Criteo's schema), drifting (the same world,
written as time-partitioned splits whose truth moves), multitask (ctr plus a planted conversion
label), video_world (the funnel's world: latent factors, exposure bias, held-out requests).
"""
