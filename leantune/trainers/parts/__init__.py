"""The parts a leantune trainer holds, each with one job: the resolved config (resolved_config.py), the split
preparer (split_preparer.py), the log-prob engine (logprob_engine.py), the run metrics (metrics/run_metrics.py),
saving (saving.py, checkpoint_files.py), GKD's teacher (teacher.py), context parallelism (context_parallel.py,
ring_order.py, shared_prompt_ring.py), frozen models' placement (frozen_models.py), the step's failure guards
(step_guards.py: the non-finite guard and its step check, the out-of-memory retry) and the launch (distributed.py,
cpu_loader.py); the step's loss normaliser is trainers/base.py's `StepLoss`. Imported by the trainers and
trainers/online, never the other way round."""
