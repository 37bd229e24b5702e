"""The parts the online trainers (GRPO, RLOO, Online DPO, PPO) are made of: rounds of prompts, a generation session,
a round builder and its metrics, a round's micro-batch in parts (round_parts.py), evaluation;
`trainers/online_trainer.py` composes them. They use trainers/parts, never the other way round."""
