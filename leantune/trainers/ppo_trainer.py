"""PPOTrainer: Proximal Policy Optimization with a value function, as a recipe over the online machinery.

Each round's completions are scored once by the generation-time policy (log-probs and values) and the reference.
Every completion token's reward is -kl_coef x its KL estimate to the reference (k1 or k3), and the completion's score
(reward functions or a reward model, minus `missing_eos_penalty` without EOS) is added on its last token; rewards
may be whitened. Generalised advantage estimation gives per-token advantages (whitened over the round) and returns.
The loss per token is PPO's clipped surrogate plus vf_coef x the clipped value loss, summed over the step's
completion tokens and divided by their count; each round is trained `num_ppo_epochs` times.

The value function (models/value_head.py) reads last hidden states, never logits: a head on the policy's own (one
body, with PEFT one frozen base, the policy's adapter and the head), or TRL's separate `value_model`. Log-probs come
from the memory engine (chunked: never [batch x length x vocabulary]), the reference is the adapter disabled under
PEFT, reward models are scored in chunks, and generation uses the online backends (transformers, vLLM).
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForSequenceClassification

from ..data.collators import MODEL_INPUTS, sequence_starts
from ..losses.policy_gradient import clipped_surrogate
from ..losses.ppo import clipped_value_loss, gae_advantages, kl_penalised_rewards, moments, token_kl, whiten
from ..losses.token_logprobs import TargetScores, count_targets, per_sequence_sum, select_targets, target_sequences
from ..models.checkpointing import checkpointing_setting, enable_model_checkpointing
from ..models.loading import load_causal_lm
from ..models.output_head import text_config_of, unwrap_model
from ..models.segment_attention import use_segment_attention
from ..models.value_head import (
    VALUE_ATTRIBUTE,
    ValueFunction,
    attach_value_function,
    detached_value_function,
    load_value_function,
    save_value_function,
)
from .online.round_builder import eos_penalised
from .online_trainer import OnlineTrainer, ScoringNeeds

logger = logging.getLogger("leantune.online")


class PPOTrainer(OnlineTrainer):
    method = "ppo"  # its entry in leantune/methods.py
    scores_policy_on_policy = True  # the generation-time values (and log-probs) make the returns and advantages

    def __init__(self, args=None, processing_class=None, model=None, ref_model=None, reward_model=None,
                 train_dataset=None, value_model=None, data_collator=None, eval_dataset=None,
                 optimizers=(None, None), callbacks=None, peft_config=None, *, reward_funcs=None,
                 reward_processing_classes=None, quantization_config=None):
        """TRL's positional order. `reward_model`: a reward model (object, id or path), or, as `reward_funcs`
        (leantune's online name), reward functions; neither: `args.reward_model_path`."""
        if model is None:
            raise ValueError("`model` is required (a causal LM object, id or path).")
        if data_collator is not None:
            raise ValueError("`data_collator`: PPO's batches are generated completions, collated by leantune; "
                             "leave it None.")
        if reward_model is not None and reward_funcs is not None:
            raise ValueError("Pass `reward_model` or `reward_funcs`, not both (both are the score's source).")
        self._value_source = value_model
        rewards = reward_model if reward_model is not None else reward_funcs
        super().__init__(model, rewards, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, reward_processing_classes=reward_processing_classes,
                         callbacks=callbacks, optimizers=optimizers, quantization_config=quantization_config,
                         peft_config=peft_config, ref_model=ref_model)

    # --- models: policy (+ value function), reference, rewards ------------------------------------------------------

    def reference_wanted(self, args) -> bool:
        return args.kl_coef != 0.0  # the KL in the reward (kl_in_reward) is measured against it

    @property
    def kl_in_reward(self) -> bool:
        """Each token's reward carries -kl_coef x its KL to the reference (kl_coef = 0: no reference, no KL)."""
        return self.args.kl_coef != 0.0

    def load_models(self, model, ref_model, processing_class, peft_config, args, quantization_config):
        if self._reward_sources[0] is None:
            if args.reward_model_path is None:
                raise ValueError("No reward source: pass `reward_model` (a reward model or its id / path, or reward "
                                 "functions as `reward_funcs`) or set `reward_model_path`.")
            self._reward_sources = (args.reward_model_path, self._reward_sources[1])
        loaded = super().load_models(model, ref_model, processing_class, peft_config, args, quantization_config)
        value_model = self._value_source
        if isinstance(value_model, str):
            value_model = load_causal_lm(value_model, args.model_init_kwargs, AutoModelForSequenceClassification,
                                         trust_remote_code=args.trust_remote_code)
        if value_model is not None:
            if self.layout.padding_free:
                use_segment_attention(value_model)
            enabled, kwargs = checkpointing_setting(args)  # transformers 5.19+ reads only the new name
            if enabled:
                enable_model_checkpointing(value_model, kwargs)
        value = ValueFunction(text_config_of(unwrap_model(loaded.model)).hidden_size, value_model)
        value.to(next(loaded.model.parameters()).device)
        attach_value_function(loaded.model, value)
        logger.info("PPO value function: %s.", "a value head on the policy's last hidden states (one body)"
                    if value.shares_policy_body else f"the separate value model {type(value_model).__name__}, its "
                    "last hidden states")
        return loaded

    @property
    def value_function(self) -> ValueFunction:
        return getattr(self.model, VALUE_ATTRIBUTE)

    @property
    def reads_hidden_states(self) -> bool:
        """The loss reads the policy's last hidden states at the targets (the value head on the policy's body)."""
        return self.value_function.shares_policy_body

    @property
    def scoring_needs(self) -> ScoringNeeds:
        return ScoringNeeds(hidden_states=self.reads_hidden_states)

    def _values(self, hidden, inputs: dict, labels: torch.Tensor) -> torch.Tensor:
        model_inputs = {k: inputs[k] for k in MODEL_INPUTS if k in inputs}
        return self.value_function.values(hidden, model_inputs, select_targets(labels).index.to(labels.device))

    # --- a round: scores, rollout values, per-token rewards, advantages and returns --------------------------------

    def attach_policy_scores(self, batch: dict, model, on_device: dict) -> None:
        scores = self.logprobs.target_logprobs(model, {k: on_device[k] for k in MODEL_INPUTS if k in on_device},
                                      on_device["labels"], self.scoring_temperature,
                                      with_hidden=self.reads_hidden_states)
        batch["old_logps"] = scores.logps.detach()
        batch["old_values"] = self._values(scores.hidden, on_device, on_device["labels"]).detach()

    def attach_loss_inputs(self, batches: list[dict], scored: dict, group: int) -> None:
        """Per-token rewards (-kl_coef x KL, the score on the last token), GAE advantages (whitened over the round)
        and returns into each micro-batch; a completion's score loses `missing_eos_penalty` if it did not end in EOS,
        one no reward scored counts 0 (counted)."""
        args = self.args
        scores = torch.nan_to_num(eos_penalised(scored, args.missing_eos_penalty), nan=0.0)
        self.rounds.spread(batches, "scores", scores)  # each completion's score (not read by the loss)
        sequences, token_rewards, kls = [], [], []
        for batch in batches:
            count = int(batch["num_sequences"])
            sequence = target_sequences(select_targets(batch["labels"]), sequence_starts(batch)).cpu()
            old = batch["old_logps"].float().cpu()
            kl = token_kl(old, batch["ref_logps"].float().cpu(), args.kl_estimator) if self.kl_in_reward \
                else torch.zeros_like(old)
            token_rewards.append(kl_penalised_rewards(kl, batch["scores"], sequence, args.kl_coef))
            sequences.append(sequence)
            kls.append(per_sequence_sum(kl, sequence, count))
        if args.whiten_rewards:
            totals = self._summed(moments(torch.cat(token_rewards)))
            token_rewards = [whiten(r, totals, shift_mean=False) for r in token_rewards]
        advantages = [gae_advantages(r, batch["old_values"].float().cpu(), s, int(batch["num_sequences"]), args.gamma,
                                     args.lam) for r, batch, s in zip(token_rewards, batches, sequences)]
        totals = self._summed(moments(torch.cat(advantages)))
        for batch, advantage in zip(batches, advantages):
            batch["returns"] = advantage + batch["old_values"].float().cpu()
            batch["token_advantages"] = whiten(advantage, totals)
        kl = self.accelerator.gather(torch.cat(kls).to(self.accelerator.device)).cpu()
        store = scored["store"]
        store["objective/kl"].append(kl.mean().item())
        store["objective/non_score_reward"].append(-args.kl_coef * kl.mean().item())
        store["objective/scores"].append(scores.mean().item())
        store["objective/rlhf_reward"].append(scores.mean().item() - args.kl_coef * kl.mean().item())

    def _summed(self, totals: torch.Tensor) -> torch.Tensor:
        """Moments over all processes (whitening uses the whole round's tokens, not one process's share)."""
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals.to(self.accelerator.device), reduction="sum")
        return totals.cpu()

    # --- the loss ------------------------------------------------------------------------------------------------

    def loss_items(self, batch: dict) -> int:
        return int(count_targets(batch["labels"]))  # completion tokens: the loss is a mean over the step's tokens

    def policy_loss(self, scores: TargetScores, sequence: torch.Tensor, batch: dict):
        args, logps = self.args, scores.logps
        device, dtype = logps.device, logps.dtype
        values = self._values(scores.hidden, batch, batch["labels"])
        advantages = batch["token_advantages"].to(device, dtype)
        policy = clipped_surrogate(logps, batch["old_logps"].to(device, dtype), advantages, args.cliprange,
                                   args.cliprange)
        value_loss, value_clipped = clipped_value_loss(values, batch["old_values"].to(device, values.dtype),
                                                       batch["returns"].to(device, values.dtype), args.cliprange_value)
        log_ratio = (logps - batch["old_logps"].to(device, dtype)).detach()
        metrics = {
            "loss/policy": policy.loss.detach().mean(),
            "loss/value": value_loss.detach().mean(),
            "policy/clipfrac": (policy.low_clipped | policy.high_clipped).float().mean(),
            "policy/approxkl": 0.5 * (log_ratio ** 2).mean(),
            "val/clipfrac": value_clipped.float().mean(),
            "val/ratio": policy.ratio.mean(),
            "val/mean": values.detach().mean(),
        }
        return policy.loss.sum() + args.vf_coef * value_loss.sum().to(dtype), metrics

    def split_problem(self) -> str | None:
        return "PPO's micro-batches are not split into parts"

    # --- saving: the policy as given, the value function beside it ------------------------------------------------

    def write_model_files(self, save_pretrained, folder: str, state_dict, **kwargs) -> None:
        gathered = None  # FSDP / ZeRO-3 hand over the full weights, gathered from the shards: the value's among them
        if state_dict is not None:
            prefix = f"{VALUE_ATTRIBUTE}."
            gathered = {k.split(prefix, 1)[1]: v for k, v in state_dict.items() if prefix in k}
            state_dict = {k: v for k, v in state_dict.items() if prefix not in k}
        with detached_value_function(self.model) as value:
            super().write_model_files(save_pretrained, folder, state_dict, **kwargs)
        if value is not None and self.args.should_save:
            save_value_function(value, folder, gathered or None)

    def load_extra_state(self, folder: str) -> None:
        """The value function saved beside the policy (which Trainer loaded, its value weights not reported missing:
        models/value_head.py), when training resumes from a checkpoint of this trainer."""
        load_value_function(self.value_function, folder)
