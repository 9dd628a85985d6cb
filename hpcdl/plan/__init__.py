"""The performance model and ``hpcdl plan``: what a job's step, epoch and time to train will be at each node count.

- :mod:`hpcdl.plan.cost`: the step model (compute, the all-reduce's alpha-beta cost, overlap, data loading);
- :mod:`hpcdl.model_facts`: each model's gradient bytes, training FLOPs and buckets, without torch;
- :mod:`hpcdl.plan.published`: the published Stampede2 runs; :mod:`hpcdl.plan.validate` checks the model on them;
- :mod:`hpcdl.plan.measured`: the model's inputs from the benchmarks' reports (the network fitted to bench
  allreduce, a node's compute from bench step, compute and overlap fitted to bench scaling: ``--calibrate``);
- :mod:`hpcdl.plan.data_path`: reading the training set at N nodes (direct, staged, cached) against the
  filesystem's bandwidth and metadata rate and node-local disk, and the path to take;
- :mod:`hpcdl.plan.planner`: the planner's inputs (flags, which source each input takes), the optimizer's state
  (its row in :data:`hpcdl.names.OPTIMIZER_TABLE`), its table and plot.

Imports go one way: planner -> measured, data_path -> validate -> published, facts, model. Nothing here imports torch.
"""
