"""GRPO, group relative policy optimization (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300), with the
normalizations of Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) and DAPO (Yu et al. 2025, arXiv:2503.14476):
objective=grpo, on data=prompts.

One optimizer step, for each prompt of its batch:

  1. rollouts  G = grpo.group_size completions sampled from the policy through the KV cache
               (gptkit.inference.rollouts: grpo.temperature, top_p, top_k; at most grpo.max_new_tokens and
               the room trainer.seq_len leaves; ended by the template's end of turn or the EOS, which they
               keep); grpo.rollouts=engine decodes every prompt's group of the micro-batch in one continuous
               batch (at most grpo.rollout_rows rows at once), groups one prompt's group per batch;
               completion r of the prompt
               at place s of the step's global batch is drawn with the key (seed, micro-step, s, r): a resumed
               step, and a run on another number of processes, draws the same completions
  2. rewards   R_i = sum_k w_k reward_k(prompt, completion_i, record)     (gptkit/training/rewards.py)
  3. advantage A_i = R_i - mean(R of the group), divided by (std(R of the group) + 1e-4) with grpo.scale=std
               (the unbiased std, as TRL's GRPOTrainer) or not (none: Dr. GRPO)
  4. loss      per completion token t of completion i (log-probs of the logits divided by grpo.temperature:
               the policy that samples, as TRL's GRPOTrainer scores it), with rho = pi(o_t) / pi_old(o_t),
               the ratio to the policy that sampled it (in the first pass pi_old = pi, detached: rho = 1,
               its gradient that of log pi), and the k3 estimate of the KL to the frozen start (Schulman
               2020) when grpo.beta > 0:
                   l_it = -min(rho A_i, clip(rho, 1 - epsilon, 1 + epsilon_high) A_i) + beta KL_it
                   KL_it = exp(ref_t - logp_t) - (ref_t - logp_t) - 1              grpo.kl=k3 (default)
                   KL_it = rho (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)        grpo.kl=k3_ratio
               (k3_ratio: TRL's use_bias_correction_kl=True, its default since 1.16; rho unclipped and not
               detached, so it changes the KL's gradient even in a first pass, where rho = 1)
               normalized over the step's completions, every micro-batch and rank (grpo.loss):
                   grpo     (1/G) sum_i (1/|o_i|) sum_t l_it          each completion's token mean, averaged
                   dr_grpo  sum_i sum_t l_it / (G max_new_tokens)     a constant: no length bias
                   dapo     sum_i sum_t l_it / sum_i |o_i|             each token of the step weighs the same
               and two losses of another ratio or weight:
                   gspo     grpo's, with the sequence-level ratio s_i = exp((1/|o_i|) sum_t (logp_t - old_t))
                            in place of rho for every token of completion i (GSPO, Zheng et al. 2025,
                            arXiv:2507.18071, eq. 5-7: the geometric mean of the token ratios, clipped
                            as a whole; TRL's importance_sampling_level="sequence", loss_type="grpo")
                   cispo    l_it = -sg(min(rho, 1 + epsilon_high)) A_i logp_t (+ the KL term), dapo's
                            normalization (CISPO, MiniMax-M1, arXiv:2506.13585, eq. 4: the IS weight clipped
                            and detached, so every token keeps a gradient; no lower clip, as the paper's
                            setting; TRL's loss_type="cispo" with its epsilon_high = 1 + gptkit's)

grpo.iterations = mu > 1: a batch's rollouts (their completions, advantages, pi_old's log-probs and the
reference's) serve mu optimizer steps, each a pass with the clipped ratio to pi_old; the datamodule's prompts
of the other mu - 1 steps are not read. The rollouts are kept, over every rank, with every checkpoint in
between, so a resume passes over the same ones. The reference's log-probs are computed once per batch of
rollouts as well. With finetune=lora the reference is the policy with its adapters switched off (as DPO's).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gptkit.data.prompts import PromptBatch
from gptkit.errors import ConfigError, GptkitError
from gptkit.evaluation.sampled import SampledSums, check_ks
from gptkit.faults import fault_point
from gptkit.inference.rollouts import SAMPLERS, RolloutOptions, sample_key
from gptkit.model.batch_invariant import batch_invariant
from gptkit.training.objectives.base import FrozenModel, Objective, frozen_words, target_logps
from gptkit.training.objectives.grpo_episodes import EpisodeRollouts, check_environment, environment_rewards
from gptkit.training.objectives.grpo_loss import (
    TOKEN_MEAN,
    check_grpo_config,
    check_is_correction,
    group_advantages,
    grpo_loss,
    is_weights,
)
from gptkit.training.objectives.grpo_rows import Figures, Rollouts, completion_rows, mean_std, sampled_rows
from gptkit.training.rewards import Rewards, load_rewards, parse_rewards, reward_timeout


class GRPO(Objective):
    """objective=grpo: group-sampled completions scored by rewards, the clipped policy-gradient loss with
    group-relative advantages (module docstring)."""

    name = "grpo"
    group = "grpo"
    data_kinds = ("prompts",)
    needs_start = True
    # the loss is the advantage-weighted log-prob, around 0 whatever the model learns: no spike notes
    loss_spikes = False
    chunked_logps = True

    @classmethod
    def check_config(cls, group: Any) -> None:
        check_grpo_config(group)
        if str(group.get("rollouts", "engine")) not in SAMPLERS:
            raise ConfigError(
                f"grpo.rollouts={group.get('rollouts')!r} is not one of {', '.join(SAMPLERS)} (engine: every "
                "prompt's group in one continuous batch; groups: one prompt's group per batch)"
            )
        rows = group.get("rollout_rows")
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ConfigError(
                f"grpo.rollout_rows={rows!r} must be null (every completion of a micro-batch at once) or an "
                "integer >= 1"
            )

    @classmethod
    def check_run(cls, cfg: Any) -> None:
        if (cfg.get("trainer") or {}).get("compile") not in (None, False, "none", "false"):
            raise ConfigError(
                "objective=grpo decodes its completions through a growing KV cache, for which a compiled "
                "block would compile again and again; use trainer.compile=none"
            )
        # the user's reward functions: loaded (and said) now, before anything is written
        load_rewards(parse_rewards(cfg.grpo.get("rewards")))
        # ---- grpo.environment (multi-turn episodes: grpo_episodes.py): loaded and said now too
        check_environment(cfg)

    @classmethod
    def rows(cls, group: Any) -> int:
        return int(group.get("group_size")) if group is not None else 1

    @classmethod
    def uses_reference(cls, group: Any) -> bool:
        return group is not None and float(group.get("beta") or 0.0) > 0

    @classmethod
    def flops(cls, counts: Any, dense: float, causal: float, group: Any = None) -> tuple[float, float]:
        """Training FLOPs per token of the rows trained on, plus, once per batch of rollouts (every
        grpo.iterations steps): their sampling (a forward per token), the sampling policy's log-probs (a
        forward, with iterations > 1) and the reference's (a forward, with beta > 0)."""
        mu = int(group.get("iterations") or 1) if group is not None else 1
        forwards = 1 + (mu > 1) + cls.uses_reference(group)
        return dense + forwards * counts.forward_dense / mu, causal + forwards * counts.forward_causal / mu

    @classmethod
    def wrong_data(cls, kind: Any) -> str:
        return (
            f"objective=grpo trains on prompts, not data kind {kind!r}: add data=prompts "
            "data.paths=[prompts.jsonl] (a prompt and the fields the rewards read)"
        )

    @classmethod
    def claimed(cls) -> str:
        return (
            "data=prompts holds prompts for reinforcement learning: add objective=grpo "
            "init_from=<run folder or checkpoint> 'grpo.rewards=[exact]'"
        )

    @classmethod
    def no_start(cls) -> str:
        return (
            "objective=grpo needs a starting checkpoint: init_from=<run folder or checkpoint> (e.g. an SFT "
            "run): its completions are what the rewards score"
        )

    @classmethod
    def batch_words(cls, batch_size: int, group: Any = None) -> str:
        n = cls.rows(group)
        return f"{batch_size} prompts x {n} completions"

    @classmethod
    def describe(cls, plan: Any) -> str | None:
        g = plan.cfg.grpo
        rewards = parse_rewards(g.rewards)
        high = g.get("epsilon_high") or g.epsilon
        start = "the base with the adapters off" if plan.lora else "a frozen copy of the starting weights"
        kl = f"KL ({g.get('kl', 'k3')}) to {frozen_words(plan, 'reference', start)}, beta {g.beta}"
        kl = kl if float(g.beta) > 0 else "no KL term (beta 0)"
        scale = "divided by the group's std" if g.scale == "std" else "not scaled (Dr. GRPO)"
        clip = {
            "cispo": f"the IS weight clipped at {1 + float(high):g}, detached",
            "gspo": f"the sequence ratio clipped to [{1 - float(g.epsilon):g}, {1 + float(high):g}]",
        }.get(str(g.loss), f"clip [{1 - float(g.epsilon):g}, {1 + float(high):g}]")
        if g.get("environment"):
            # ---- grpo.environment: episodes, the environment's reward (grpo_episodes.py)
            return (
                f"GRPO: {g.group_size} episodes per prompt in {g.environment} (at most {g.max_turns} model "
                f"turns of {g.max_new_tokens} new tokens, temperature {g.temperature}, top_p {g.top_p}), "
                f"reward its score and turn rewards; advantages {scale}; {g.loss} loss, {clip}, "
                f"{g.iterations} pass(es) per batch of rollouts; {kl}"
            )
        forwards = (
            "batch-invariant forwards (sampler and trainer log-probs equal in fp32 on the CPU)"
            if g.get("batch_invariant")
            else "torch's forwards (not batch-invariant)"
        )
        cap = g.get("is_correction")
        forwards += f", IS correction capped at {cap:g}" if cap is not None else ""
        return (
            f"GRPO: {g.group_size} completions per prompt (temperature {g.temperature}, top_p {g.top_p}, "
            f"at most {g.max_new_tokens} new tokens), rewards {rewards.describe()}; advantages {scale}; "
            f"{g.loss} loss, {clip}, {g.iterations} "
            f"pass(es) per batch of rollouts; {kl}; {forwards}"
        )

    def __init__(self, plan: Any, frozen: dict[str, FrozenModel] | None = None) -> None:
        super().__init__(plan, frozen)
        g = self.settings
        self.rewards: Rewards = load_rewards(parse_rewards(g.rewards), announce=False)
        self.group_size, self.mu = int(g.group_size), int(g.iterations)
        self.scale, self.loss_type = str(g.scale), str(g.loss)
        self.epsilon = float(g.epsilon)
        self.epsilon_high = float(g.get("epsilon_high") or g.epsilon)
        self.beta = float(g.beta)
        self.kl = str(g.get("kl", "k3"))
        # the sampler's and the trainer's forwards in the batch-invariant ops; the IS correction's cap
        self.invariant = bool(g.get("batch_invariant"))
        self.is_cap = check_is_correction(g.get("is_correction"))
        self.rewards.timeout = reward_timeout(g.get("reward_timeout"))
        self.val_temperature = float(g.get("val_temperature") or 0.0)
        self.val_samples, self.val_ks = check_ks(g.get("val_k"), int(g.get("val_samples") or 1))
        # val_samples > 1: per checker and k, the sums of pass@k (and maj@k) over the val prompts, and their
        # count (every rank holds every key: one reduce)
        self.sampled = SampledSums(self.rewards.rewards, self.val_ks) if self.val_samples > 1 else None
        self.seed, self.seq_len = int(plan.cfg.seed), int(plan.seq_len)
        self.accumulation, self.batch_size = int(plan.accumulation), int(plan.batch_size)
        data = plan.cfg.data
        self.prompt_field, self.messages_field = (
            str(data.get("prompt_field")),
            str(data.get("messages_field")),
        )
        tok = plan.data.manifest["tokenizer"]
        # a completion ends at the template's end of turn or the EOS (and keeps it)
        stops = tuple(i for i in (tok.get("end_of_turn_id"), tok.get("eos_id")) if i is not None)
        self.opts = RolloutOptions(
            int(g.max_new_tokens),
            float(g.temperature),
            g.get("top_k") or None,
            float(g.get("top_p", 1.0)),
            stops,
        )
        self.pad_id = int(tok.get("pad_id") or 0)
        # how a micro-batch's groups are decoded (gptkit.inference.rollouts.SAMPLERS), at most rollout_rows
        # completions at once with the engine
        self.sampler = str(g.get("rollouts", "engine"))
        self.rollout_rows = g.get("rollout_rows")
        self.tokenizer = plan.data.tokenizer()
        # ---- grpo.environment: episodes instead of single completions, the environment's reward parts
        self.episodes: EpisodeRollouts | None = None
        if g.get("environment"):
            self.episodes = EpisodeRollouts(plan, g, self.tokenizer, self.opts)
            self.rewards, self.sampled = environment_rewards(g.environment), None
        # ----
        self.train = Figures(self.rewards.names)
        self.val = Figures(self.rewards.names)
        # grpo.iterations > 1: the round of rollouts kept, and each micro-batch's (over every rank)
        self.kept_round: int | None = None
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        self._clock: float | None = None
        self._val_seconds = 0.0

    # ---- rollouts ---------------------------------------------------------------------------------------
    def _lockstep(self, model):
        """FSDP2 (sharded weights: every forward is collective): whether any rank still decodes."""
        if not getattr(model, "_gptkit_sharded", False) or not (
            dist.is_available() and dist.is_initialized()
        ):
            return None
        device = model.tok_emb.weight.device

        def any_active(active: bool) -> bool:
            flag = torch.tensor([int(active)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return bool(flag.item())

        return any_active

    def _text(self, tokens: list[int]) -> str:
        """A completion's text, its stop token left out."""
        if tokens and tokens[-1] in self.opts.stop_ids:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def _prompt_of(self, row: dict) -> Any:
        """What a reward function gets as the prompt: the record's prompt text, else its messages."""
        p = row.get(self.prompt_field)
        return p if isinstance(p, str) else row.get(self.messages_field)

    def _score(self, batch: PromptBatch, groups) -> tuple[list, list]:
        """(scores[p][i][k], totals[p][i]) of every completion."""
        scores, totals = [], []
        # the reward models' scores: one batched forward of every completion with its prompt
        seqs = [p + c.tokens for p, group in zip(batch.prompts(), groups) for c in group]
        given = iter(self.rewards.model_scores(seqs, batch.ids.device, self.tokenizer))
        # the reward calls' signal handlers (their time limit, a Ctrl-C told from the reward's own), once
        with self.rewards.guard():
            for row, where, group in zip(batch.rows, batch.where, groups):
                prompt = self._prompt_of(row)
                s = [self.rewards.score(prompt, self._text(c.tokens), row, where, next(given)) for c in group]
                scores.append(s)
                totals.append([self.rewards.total(x, where) for x in s])
        return scores, totals

    def sample(self, model, batch: PromptBatch, n: int, temperature: float, step: int) -> tuple[list, float]:
        """(per prompt its n completions, seconds): drawn with the keys (seed, step, slot, r)."""
        prompts = batch.prompts()
        opts = RolloutOptions(
            self.opts.max_new_tokens, temperature, self.opts.top_k, self.opts.top_p, self.opts.stop_ids
        )
        keys = [[sample_key(self.seed, step, s, r) for r in range(n)] for s in batch.slots.tolist()]
        budgets = [min(self.opts.max_new_tokens, self.seq_len - len(p)) for p in prompts]
        t = time.perf_counter()
        extra = {"max_rows": self.rollout_rows} if self.sampler == "engine" else {}
        with batch_invariant(model, self.invariant):
            groups = SAMPLERS[self.sampler](
                model, prompts, keys, opts, budgets, self._lockstep(model), **extra
            )
        return groups, time.perf_counter() - t

    def rollouts(self, model, batch: PromptBatch) -> Rollouts:
        """Sample, score and turn into rows one micro-batch's completions (steps 1-3 of the module docstring);
        with iterations > 1 the sampling policy's log-probs, and with a reference its log-probs."""
        step = int(batch.step)
        device = batch.ids.device
        if self.episodes is not None:
            # ---- grpo.environment: each completion an episode, its row the rendered record (grpo_episodes)
            groups, seconds = self.episodes.play(
                model, batch, self.group_size, self.opts.temperature, step, self._lockstep(model)
            )
            scores, totals = self.episodes.scores(groups)
            self.episodes.log(groups, batch, step, self._rank())
            x, y = self.episodes.rows(groups, self.pad_id)
            lengths, cut = self.episodes.count(groups)
        else:
            groups, seconds = self.sample(model, batch, self.group_size, self.opts.temperature, step)
            scores, totals = self._score(batch, groups)
            completions = [c.tokens for group in groups for c in group]
            x, y = completion_rows(batch.prompts(), completions, self.pad_id)
            lengths = [len(c) for c in completions]
            cut = sum(c.stop_reason != "stop" for group in groups for c in group)
        rewards = torch.tensor(totals, dtype=torch.float32, device=device)  # [P, G]
        advantages = group_advantages(rewards, self.scale).flatten()  # [N]
        x, y = x.to(device), y.to(device)
        self.train.add_rollouts(scores, totals, lengths, cut, seconds)
        # the sampler's own log-probs (single-turn; an episode's rows are its rendered record: None)
        sampled = None if self.episodes is not None else sampled_rows(batch.prompts(), groups, y.shape)
        out = Rollouts(x, y, advantages, sampled=None if sampled is None else sampled.to(device))
        if self.mu > 1:
            with torch.no_grad(), batch_invariant(model, self.invariant):
                out.old = target_logps(model, x, y, self.opts.temperature)
        if self.reference is not None:
            with torch.no_grad():
                out.ref = self.reference.logps(model, x, y, self.opts.temperature)
        return out

    def _kept(self, model, batch: PromptBatch) -> Rollouts:
        """grpo.iterations > 1: this micro-batch's rollouts of the current round, over every rank (sampled now
        in the round's first step, else the ones kept), this rank's rows."""
        step = int(batch.step)
        opt_step, micro = divmod(step, self.accumulation)
        rnd, k = divmod(opt_step, self.mu)
        if k == 0 or self.kept_round != rnd or micro not in self.kept:
            if k:
                raise GptkitError(
                    f"grpo.iterations={self.mu}: step {opt_step} passes again over the rollouts of step "
                    f"{rnd * self.mu}, which this run does not hold"
                )
            if self.kept_round != rnd:
                self.kept_round, self.kept = rnd, {}
            self.kept[micro] = self._gather(self.rollouts(model, batch).to_dict())
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        every = Rollouts.from_dict(self.kept[micro], batch.ids.device)
        n = self.batch_size * self.group_size
        return every.rows(rank * n, (rank + 1) * n)

    def _gather(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's rollouts of a micro-batch, in rank order, padded to one length (as a checkpoint keeps
        them; every rank reads its own rows from them, on resume as now)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return mine
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        t = max(d["x"].shape[1] for d in every)
        fill = {"x": self.pad_id, "y": -100, "old": 0.0, "ref": 0.0, "sampled": 0.0}
        out = {}
        for key in mine:
            parts = [d[key] for d in every]
            if key in fill:
                parts = [F.pad(p, (0, t - p.shape[1]), value=fill[key]) for p in parts]
            out[key] = torch.cat(parts)
        return out

    # ---- the loss ---------------------------------------------------------------------------------------
    def loss(self, model, batch: PromptBatch):
        """The GRPO loss of one micro-batch of prompts: their rollouts (sampled now, or kept from the first
        step of this round with iterations > 1), then one pass (module docstring). Weight: dapo and cispo the
        completion tokens (every token of the step weighs the same); grpo, dr_grpo and gspo None (every
        micro-batch holds as many completions)."""
        if self._clock is None:
            self._clock = time.perf_counter()
        ro = self._kept(model, batch) if self.mu > 1 else self.rollouts(model, batch)
        fault_point("rollout")
        with batch_invariant(model, self.invariant):
            logps = target_logps(model, ro.x, ro.y, self.opts.temperature)  # [N, T]
        mask = ro.y != -100  # [N, T]
        old = ro.old if ro.old is not None else logps.detach()
        weight = None
        if ro.sampled is not None:
            # the trainer's log-prob of the weights that sampled against the sampler's own
            diff = (old - ro.sampled).abs().masked_fill(~mask, 0.0)  # [N, T]
            self.train.add_max("rollout_logprob_diff", diff.max())
            if self.is_cap is not None:
                weight = is_weights(old, ro.sampled, self.is_cap)  # [N, T]
                self.train.add_loss({"is_capped": ((weight >= self.is_cap) & mask).sum()})
        value, figures = grpo_loss(
            logps,
            old,
            ro.advantages,
            mask,
            epsilon_low=self.epsilon,
            epsilon_high=self.epsilon_high,
            beta=self.beta,
            ref_logps=ro.ref,
            loss=self.loss_type,
            max_new_tokens=self.opts.max_new_tokens,
            kl=self.kl,
            is_weight=weight,
        )
        self.train.add_loss(figures)
        if self.loss_type in TOKEN_MEAN:
            return value, mask.sum()
        return value, None

    # ---- validation -------------------------------------------------------------------------------------
    def validate(self, model, batch: PromptBatch, rank: int, world_size: int, val_sources) -> None:
        """One completion of each val prompt (greedy, or sampled at grpo.val_temperature with the key (seed,
        -1, index, 0)), scored; each val prompt counted once over the ranks (index % world == rank, where
        DistributedSampler puts it first)."""
        t = time.perf_counter()
        mine = [(i % world_size) == rank for i in batch.index.tolist()]
        keep = [i for i, m in enumerate(mine) if m]
        if self.episodes is not None:
            # ---- grpo.environment: one episode per val prompt of this rank (keys (seed, -1, index, 0))
            sub = self._rows_of(batch, keep)
            if keep:
                groups, seconds = self.episodes.play(
                    model, sub, self.val_samples, self.val_temperature, -1, self._lockstep(model)
                )
                scores, totals = self.episodes.scores(groups)
                lengths, _ = self.episodes.count(groups, "val")
                self.val.add_rollouts(scores, totals, lengths, 0, seconds)
            if self._clock is not None:
                self._val_seconds += time.perf_counter() - t
            return
        groups, seconds = self.sample(model, batch, self.val_samples, self.val_temperature, -1)
        # a validation inside a train window is not its wall time
        if keep:
            sub = PromptBatch(
                batch.ids[keep],
                batch.lengths[keep],
                batch.index[keep],
                batch.slots[keep],
                batch.step,
                [batch.rows[i] for i in keep],
                [batch.where[i] for i in keep],
            )
            groups = [groups[i] for i in keep]
            scores, totals = self._score(sub, groups)
            lengths = [len(c.tokens) for g in groups for c in g]
            cut = sum(c.stop_reason != "stop" for g in groups for c in g)
            self.val.add_rollouts(scores, totals, lengths, cut, seconds)
            if self.sampled is not None:
                self.sampled.add(scores, [[self._text(c.tokens) for c in g] for g in groups])
        if self._clock is not None:
            self._val_seconds += time.perf_counter() - t

    @staticmethod
    def _rows_of(batch: PromptBatch, keep: list[int]) -> PromptBatch:
        return PromptBatch(
            batch.ids[keep],
            batch.lengths[keep],
            batch.index[keep],
            batch.slots[keep],
            batch.step,
            [batch.rows[i] for i in keep],
            [batch.where[i] for i in keep],
        )

    @staticmethod
    def _rank() -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _metrics(self, sums: dict[str, Any], prefix: str) -> dict[str, float]:
        h, k = sums["host"], len(self.rewards.names)
        n = h[0]
        out: dict[str, float] = {}
        if n:
            out[f"{prefix}/reward"], out[f"{prefix}/reward_std"] = mean_std(h[1 + 2 * k], h[2 + 2 * k], n)
            for j, r in enumerate(self.rewards.rewards):
                mean, std = mean_std(h[1 + 2 * j], h[2 + 2 * j], n)
                out[f"{prefix}/rewards/{r.name}"], out[f"{prefix}/rewards/{r.name}_std"] = mean, std
                if r.checker:
                    out[f"{prefix}/accuracy/{r.name}"] = mean
            out[f"{prefix}/completion_len"] = h[5 + 2 * k] / n
            out[f"{prefix}/completion_len_max"] = sums["longest"]
            out[f"{prefix}/completions_cut"] = h[6 + 2 * k] / n
        return out

    def val_metrics(self, strategy, val_sources) -> dict[str, Any]:
        """val/reward (and each reward's, each checker's accuracy) of the val prompts' completions, and
        val/loss = -val/reward (lower is better: best.ckpt keeps the highest reward)."""
        sums = self.val.read(strategy, self._device(strategy))
        if sums is None or not sums["host"][0]:
            return {}
        out = self._metrics(sums, "val")
        if self.episodes is not None:
            out.update(self.episodes.metrics(strategy, self._device(strategy), "val"))
        if self.sampled is not None:
            out.update(self.sampled.read(strategy, self._device(strategy)))
        return {"val/loss": -out["val/reward"], **out}

    def train_metrics(self, strategy) -> dict[str, float]:
        """The rollouts' rewards, their groups without reward variance, completion lengths, the clip
        fraction and KL of the passes, and the wall time split between sampling and the rest."""
        now = time.perf_counter()
        sums = self.train.read(strategy, self._device(strategy))
        if sums is None:
            return {}
        out = self._metrics(sums, "train")
        if self.episodes is not None:
            out.update(self.episodes.metrics(strategy, self._device(strategy), "train"))
        h, k = sums["host"], len(self.rewards.names)
        if h[3 + 2 * k]:
            out["train/groups_zero_std"] = h[4 + 2 * k] / h[3 + 2 * k]
        tokens = sums.get("tokens", 0.0)
        if tokens:
            units = sums.get("clip_units") or tokens
            out["train/clip_fraction"] = sums.get("clipped", 0.0) / units
            if "kl" in sums:
                out["train/kl"] = sums["kl"] / tokens
            if "is_capped" in sums:
                out["train/is_capped"] = sums["is_capped"] / tokens
        if "rollout_logprob_diff" in sums:
            out["train/rollout_logprob_diff"] = sums["rollout_logprob_diff"]
        world = strategy.world_size if strategy is not None else 1
        generation = h[7 + 2 * k] / max(1, world)
        if self._clock is not None:
            wall = max(1e-9, now - self._clock - self._val_seconds)
            out["time/generation_s"] = generation
            out["time/training_s"] = max(0.0, wall - generation)
            out["time/generation_share"] = min(1.0, generation / wall)
        # the next window starts at its first loss (no validation or checkpoint before it counts)
        self._clock, self._val_seconds = None, 0.0
        return out

    @staticmethod
    def _device(strategy):
        return strategy.root_device if strategy is not None else torch.device("cpu")

    # ---- what the line and the end say ------------------------------------------------------------------
    def _accuracy_key(self, prefix: str) -> str | None:
        checker = next((r for r in self.rewards.rewards if r.checker), None)
        return f"{prefix}/accuracy/{checker.name}" if checker is not None else None

    def progress(self, metrics: dict[str, float]) -> list[str]:
        if "train/reward" not in metrics:
            return []
        parts = [f"reward {metrics['train/reward']:.3f}"]
        key = self._accuracy_key("train")
        if key in metrics:
            parts.append(f"{key.rsplit('/', 1)[-1]} {metrics[key]:.0%}")
        if "time/generation_share" in metrics:
            parts.append(f"sampling {metrics['time/generation_share']:.0%}")
        if "train/rollout_logprob_diff" in metrics:
            parts.append(f"logprob diff {metrics['train/rollout_logprob_diff']:.2g}")
        return ["  ".join(parts)]

    def val_progress(self, metrics: dict[str, Any]) -> str:
        reward = metrics.get("val/reward")
        if reward is None:
            return ""
        key = self._accuracy_key("val")
        acc = f"  val {key.rsplit('/', 1)[-1]} {float(metrics[key]):.1%}" if key in metrics else ""
        return f"  val reward {float(reward):.3f}{acc}"

    def summary(self, metrics: dict[str, Any]) -> str | None:
        reward = metrics.get("val/reward")
        if reward is None:
            return None
        key = self._accuracy_key("val")
        acc = f" ({key.rsplit('/', 1)[-1]} {float(metrics[key]):.1%})" if key in metrics else ""
        return f"val reward {float(reward):.4f}{acc}"

    # ---- resume -----------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        """grpo.iterations > 1: the round's rollouts of every micro-batch and rank (a resume inside the round
        passes over them again)."""
        if self.mu == 1 or self.kept_round is None or not self.kept:
            return None
        return {"round": int(self.kept_round), "micro": {int(m): d for m, d in self.kept.items()}}

    def load_state(self, state: dict[str, Any] | None) -> None:
        if state and self.mu > 1:
            self.kept_round = int(state["round"])
            self.kept = {int(m): d for m, d in state["micro"].items()}
