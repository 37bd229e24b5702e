"""The parts the online trainers (GRPO, RLOO, Online DPO, PPO) are made of: rounds of prompts, a generation session,
a round builder and its metrics, evaluation; `trainers/online_trainer.py` composes them."""
