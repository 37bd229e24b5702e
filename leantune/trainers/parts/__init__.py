"""The parts a leantune trainer holds, each with one job: the resolved config (resolved_config.py), the split
preparer (split_preparer.py), the log-prob engine (logprob_engine.py), the step's loss normaliser (step_loss.py), the
run metrics (run_metrics.py), saving (saving.py) and GKD's teacher (teacher.py). Context parallelism is a part too
(trainers/context_parallel.py). Imported by the trainers, never the other way round."""
