"""GKDTrainer: Generalized Knowledge Distillation (arXiv 2306.13649), as a recipe over SFT's data and leantune's
memory engine.

The student learns the frozen teacher's next-token distribution on the completion tokens: the generalised JSD of
losses/distillation.py (from hidden states, chunk by chunk, or Liger's fused linear JSD; full logits only with
`chunked_loss=False`), summed over the targets and divided by the step's target count. On a `lmbda` share of the
optimizer steps (decided per step from the seed) the completions trained on are the student's own samples
(on-policy); with `seq_kd`, the other steps train on the teacher's samples; otherwise on the dataset's completions.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch

from ..data.collators import CausalLMCollator, prompt_completion_row, sequence_prompts
from ..data.formats import last_message_as_completion
from ..generation import GenerationSession, SamplingSettings
from ..generation.backend import TRANSFORMERS, backend_factory
from ..losses.distillation import chunked_jsd_sum, jsd_from_logits
from ..losses.liger import liger_jsd_problem, liger_jsd_sum
from ..losses.token_logprobs import IGNORE_INDEX, count_targets, select_targets
from ..models.loading import parse_kwargs
from .gkd_config import GKDConfig
from .parts.context_parallel import data_parallel_place, generation_group
from .parts.teacher import Teacher
from .reference import disable_dropout
from .settings import generation_of
from .sft_trainer import SFTTrainer

logger = logging.getLogger("leantune.gkd")


@dataclass(frozen=True)
class DistillationSampling:
    """What the generation session reads to sample GKD's completions, under the online configs' names: transformers'
    generate (GKD has no vLLM option), `max_new_tokens` at `temperature` with no top-k/top-p (TRL's GKD), and whether
    ZeRO-3's shards are gathered once for the call (the student's; the frozen teacher generates as it scores)."""

    seed: int
    max_completion_length: int
    temperature: float
    ds3_gather_for_generation: bool
    use_vllm: bool = False
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict | None = None
    max_completions_per_generate: int | None = None


class GKDTrainer(SFTTrainer):
    """Distil a teacher into the trained model on prompt-completion or conversational data."""

    method = "gkd"  # its entry in leantune/methods.py

    def __init__(self, model=None, teacher_model=None, args: GKDConfig | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), preprocess_logits_for_metrics=None, peft_config=None,
                 formatting_func=None):
        args = self.default_args(model, args)
        teacher_model = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        if teacher_model is None:
            raise ValueError("GKD needs a teacher: pass `teacher_model` (an id, a path or a model object) or set "
                             "`teacher_model_name_or_path`.")
        if teacher_model is model and not isinstance(model, str):
            raise ValueError("`teacher_model` is the student `model` itself, so the teacher would train with it: pass "
                             "a separate model (or an id / path).")
        if args.teacher_model_init_kwargs is not None and not isinstance(teacher_model, str):
            raise ValueError("`teacher_model_init_kwargs` only apply to a teacher given by id or path; the "
                             "`teacher_model` passed is already a model object.")
        self._teacher_source = teacher_model
        super().__init__(model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, compute_metrics=compute_metrics,
                         callbacks=callbacks, optimizers=optimizers,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics, peft_config=peft_config,
                         formatting_func=formatting_func)
        self.teacher.place(self.accelerator, self.args)
        self.generation_collator = CausalLMCollator(
            pad_token_id=self.processing_class.pad_token_id, loss_mask_columns=("completion_mask",),
            padding_free=self.layout.padding_free or self.layout.packing, pad_to_multiple_of=self.layout.pad_to_multiple_of)
        # who samples a step's completions: the student (as the online trainers' policy: its wrapped model, synced
        # each step, its ZeRO-3 shards gathered for the call) or the frozen teacher
        self.generation_sessions = {
            "student": self.sampling_session(self.model, lambda: self.model_wrapped, gathered=True),
            "teacher": self.sampling_session(self.teacher.model, lambda: self.teacher.model, gathered=False)}
        self.on_policy_steps = 0

    def sampling_session(self, model, policy, gathered: bool) -> GenerationSession:
        """A generation session sampling from `policy()` (`model`: whose EOS ids end a completion)."""
        sampling = DistillationSampling(self.args.seed, self.args.max_new_tokens, self.args.temperature, gathered)
        return GenerationSession(generation_of(sampling),
                                 SamplingSettings.from_config(sampling, self.processing_class, model),
                                 backend_factory(TRANSFORMERS, sampling, self.processing_class, self.accelerator), self.accelerator,
                                 policy, step=lambda: self.state.global_step, method=self.method,
                                 rank=data_parallel_place(self.accelerator)[0],
                                 in_group=generation_group(self.accelerator))

    def default_args(self, model, args):
        if args is not None and not isinstance(args, GKDConfig):
            raise TypeError(f"GKDTrainer takes a GKDConfig, got {type(args).__name__}.")
        return super().default_args(model, args)

    # --- construction: the student as SFT loads it, and the frozen teacher --------------------------------------

    def load_models(self, model, ref_model, processing_class, peft_config, args, quantization_config):
        loaded = super().load_models(model, ref_model, processing_class, peft_config, args, quantization_config)
        self.teacher = Teacher(self._teacher_source, loaded.model, parse_kwargs(args.teacher_model_init_kwargs),
                               args.trust_remote_code, self.layout.packing or self.layout.padding_free)
        if args.disable_dropout:
            disable_dropout(loaded.model)
        return loaded

    def frozen_model_sources(self) -> dict:
        return {"teacher_model": self._teacher_source}

    @property
    def teacher_model(self) -> torch.nn.Module:
        """TRL's attribute: the teacher as placed for the engine."""
        return self.teacher.model

    def frozen_models(self) -> list[torch.nn.Module]:
        return [*super().frozen_models(), self.teacher.model]

    def liger_notes(self, args) -> list[tuple[int, str]]:
        problem = liger_jsd_problem(self.logprobs.head_kind.of(self.model), self.teacher.head, args.device.type)
        if problem is None:
            return super().liger_notes(args)
        return [*super().liger_notes(args), (logging.WARNING, f"Liger was asked for, but {problem}; using leantune's "
                                                              "chunked JSD instead (same memory saving, exact).")]

    def prepare_split(self, dataset, split, tokenizer, args):
        """SFT's preparation; a `messages` dataset trains on its last message, as in TRL's GKD."""
        if not self.skips_preparation(args):
            dataset = last_message_as_completion(dataset)
        return super().prepare_split(dataset, split, tokenizer, args)

    # --- each optimizer step: the dataset's completions, the student's own (on-policy) or the teacher's ---------

    def completion_source(self, step: int) -> str | None:
        """Who writes this step's completions: "student" (a `lmbda` share of steps), "teacher" (`seq_kd`, the other
        steps) or None (the dataset's). The same on every process: it depends on the seed and the step only."""
        if random.Random(self.args.seed * 1_000_003 + step).random() < self.args.lmbda:
            return "student"
        return "teacher" if self.args.seq_kd else None

    def trained_batches(self, batches: list) -> list:
        """The step's micro-batches, regenerated when the step trains on generated completions (then counted, so
        the loss is divided by the target count of what is actually trained on)."""
        source = self.completion_source(self.state.global_step) if batches else None
        if source is not None:
            self.on_policy_steps += source == "student"
            batches = [self.generated_batch(batch, source, i) for i, batch in enumerate(batches)]
        return batches

    def generated_batch(self, batch: dict, source: str, micro_batch: int) -> dict:
        """The batch's prompts with completions sampled from the student or the teacher through its generation
        session (`max_new_tokens`, `temperature`, no top-k/top-p, as TRL; a seed per step, process and micro-batch),
        in the trainer's layout; completion tokens (to the first EOS, kept) are the targets."""
        session, prompts = self.generation_sessions[source], sequence_prompts(batch)
        seed = self.args.seed + 1_000_003 * self.state.global_step + 7919 * self.args.process_index + micro_batch
        completions = session.generate(prompts, session.sampling, seed=seed)
        return self.generation_collator([prompt_completion_row(p, c) for p, c in zip(prompts, completions)])

    # --- the loss ----------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Generalised JSD(student, teacher) summed over the completion tokens, over the step's target count."""
        inputs = dict(inputs)
        # under context parallelism the targets arrive shifted and split; the JSD is summed per token, so each
        # process's part of the sum adds up over the group as SFT's NLL does
        shifted = inputs.pop("shift_labels", None)
        labels = inputs.pop("labels") if shifted is None else shifted
        if shifted is not None:
            self.context_parallel.check_layout(inputs)
        self.run_metrics.count_tokens(model, inputs)
        targets = select_targets(labels, shifted=shifted is not None)
        beta = self.args.beta
        if self.logprobs.needs_full_logits(model):
            outputs, _ = self.logprobs.forward(model, inputs)
            loss_sum = jsd_from_logits(outputs.logits, self.teacher.logits(inputs), targets, beta).sum()
        else:
            head, teacher_head = self.logprobs.head_kind.of(model), self.teacher.head
            hidden, outputs = self.logprobs.forward_hidden(model, inputs, head)
            teacher_hidden = self.teacher.hidden_states(inputs, teacher_head)
            if len(targets) and self.logprobs.liger_jsd_runs(head, teacher_head):
                loss_sum = liger_jsd_sum(hidden, head, teacher_hidden, teacher_head, targets, beta)
            else:
                loss_sum = chunked_jsd_sum(hidden, head, teacher_hidden, teacher_head, targets, beta,
                                           self.settings.head.loss_chunk_size)
        local_count = (labels != IGNORE_INDEX).sum() if shifted is not None else count_targets(labels)
        loss = self.step_loss.normalise(self.model, loss_sum, local_count, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def context_parallel_problem(self, args) -> str | None:
        if args.lmbda > 0 or args.seq_kd:
            return (f"generated completions (`lmbda={args.lmbda}`, `seq_kd={args.seq_kd}`: sampled outside the "
                    f"ring; `lmbda=0` and `seq_kd=False` train on the dataset's)")
        return None
