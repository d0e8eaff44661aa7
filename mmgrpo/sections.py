"""The fixed sections of an experiment config: ``train`` ([`TrainConfig`]: optimisation, rollout sizes, distribution,
prompt sampling), ``eval`` ([`EvalConfig`]), ``checkpoint`` ([`CheckpointConfig`]) and ``sft`` ([`SFTConfig`]), each
checked in ``__post_init__`` with its bounds. [`mmgrpo.config`] assembles them with the plugins' options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .validation import KEY, ConfigError, check_fields, check_range, check_seed, check_text
from .vas import VASConfig, check_sampling
from .weight_ema import EMAConfig

STEPS_LIMIT = 10**9  # trainer steps (and the step counts of warm-up, evaluation, checkpoints, logging)
SECONDS_LIMIT = 10**8  # a time budget in seconds (three years)
SAMPLES_LIMIT = 2**20  # samples per step (prompts x group size), and held-out prompts per evaluation
# the sizes of one step: a refusal beyond these limits, which no real run reaches
SIZE_LIMITS = {"max_steps": STEPS_LIMIT, "prompts_per_step": 2**16, "group_size": 1024, "minibatch_size": 2**16,
               "updates_per_step": 1024, "inner_epochs": 1024}
SIZE_FIXES = {"prompts_per_step": "real runs use 8 to ~1024 prompts per step",
              "group_size": "real runs use 4 to ~64 samples per prompt",
              "minibatch_size": "samples per backward pass; gradients accumulate over minibatches"}
STALENESS_LIMIT = 16  # steps a rollout may lag the weights (asynchronous runs use 1 to ~4; each holds a batch in memory)


@dataclass
class AsyncConfig:
    """``train.async``: asynchronous training, rollouts produced ahead of the updates from a rollout copy of the policy
    (see [`mmgrpo.async_rollouts`] and ``docs/distributed.md``).

    Args:
        max_staleness (`int`): `k`. Step `t`'s rollout is sampled from the weights after step ``t - 1 - k`` (the
            initial ones for the first steps), with the per-step seeds of synchronous training, while the trainer
            updates on the steps before it: the rollouts of steps ``t + 1 .. t + k`` are sampled and rewarded while
            step `t` updates. 0 samples each step from the latest weights (the same metrics as synchronous training).
    """

    max_staleness: int = 1

    def __post_init__(self):
        check_fields(self)
        check_range("train.async.max_staleness", self.max_staleness, 0, STALENESS_LIMIT,
                    fix="1 overlaps one step's sampling with the previous step's updates; 0 is synchronous")


def check_async(train) -> None:
    """Refuses ``train.async`` with what needs each step's results before the next batch is drawn, or sharded weights."""
    if train.async_ is None:
        return
    if train.prompt_sampling != "uniform":
        raise ConfigError(f"train.async cannot run with train.prompt_sampling: {train.prompt_sampling} (it picks each "
                          "step's prompts from the previous steps' rewards): use uniform, or leave train.async out.")
    if train.sharding in ("fsdp", "hybrid"):
        raise ConfigError(f"train.async needs each process to hold the whole trained weights for its rollout copy: "
                          f"use train.sharding: ddp (or none), not {train.sharding}, or leave train.async out.")


@dataclass
class TrainConfig:
    """Optimisation and rollout sizes.

    Args:
        max_steps (`int`): number of trainer steps (one rollout batch and its updates each).
        max_seconds (`float`): wall-clock training budget in seconds; 0 (the default) sets none. Only the time spent
            in training steps (rollout, reward, updates; logged as ``time/step_s``, cumulated as ``time/train_s``)
            counts: start-up, evaluation and checkpointing do not. The run stops after the step during which the
            total passed the budget (or at `max_steps`, whichever comes first), then evaluates and saves as after
            the last step. The total is kept in checkpoints, so a resumed run continues the same budget.
        async (`AsyncConfig`, *optional*): ``{max_staleness: k}``: asynchronous training, rollouts sampled `k` steps
            ahead from a rollout copy of the policy (see [`AsyncConfig`]); unset (the default): synchronous.
        prompts_per_step (`int`): distinct prompts sampled per step, over all processes (`B`).
        group_size (`int`): samples per prompt (`G`); `B * G` must divide evenly across processes.
        minibatch_size (`int`): samples per backward pass; gradients accumulate over minibatches.
        updates_per_step (`int`): optimizer updates per rollout batch (minibatches are split between them).
        inner_epochs (`int`): passes over each rollout batch.
        learning_rate (`float`), weight_decay (`float`), adam_betas (`list[float]`), adam_eps (`float`): AdamW.
        optim (`str`): AdamW's implementation, by transformers' `TrainingArguments.optim` names: ``"adamw_torch"``
            (the default: `torch.optim.AdamW` as torch picks it, a loop over the parameters on the CPU, foreach on
            GPUs) or ``"adamw_torch_fused"`` (``fused=True``: one kernel for all parameters, transformers' default
            for torch >= 2.8; the same update up to float rounding, on CPUs and GPUs).
        warmup_steps (`int`): linear learning-rate warm-up, in optimizer updates.
        lr_schedule (`str`): after warm-up, ``"constant"`` or ``"cosine"`` (decays to ``min_lr_ratio`` times the
            learning rate at the last update; group-relative RL on small models tends to gain fast and then
            oscillate, and a decay keeps what was gained).
        min_lr_ratio (`float`): final learning rate of the cosine schedule, as a fraction of `learning_rate`.
        prompt_sampling (`str`), vas (`VASConfig`): ``"uniform"`` (a seeded shuffle per epoch), ``"vas"`` (MMR1's
            variance-aware sampling from extra rollouts; options in `vas`, see [`mmgrpo.vas`]) or ``"group_variance"``
            (by the training groups' reward variance); see [`~mmgrpo.prompt_stream.PromptStream`]. Checkpointed.
        prompt_sampling_mix (`float`): MMR1's mixture ratio under ``"vas"`` (in [0, 1]), else the share by variance.
        max_grad_norm (`float`): gradient clipping.
        mixed_precision (`str`): ``"no"``, ``"bf16"`` or ``"fp16"`` (accelerate's autocast; under ``sharding:
            fsdp`` with several processes, ``bf16`` is FSDP2's mixed precision: bf16 compute, fp32 gradient reduction
            and fp32 sharded weights, and ``fp16`` is refused).
        sharding (`str`): how a multi-process run distributes the trained module: ``"ddp"`` (every process holds
            all of it), ``"fsdp"`` (FSDP2: parameters, gradients and optimizer state sharded per transformer block),
            ``"hybrid"`` (HSDP: sharded within each node, replicated across nodes; every node runs the same number of
            processes) or ``"none"`` (a single process; a multi-process launch is refused). One process is never
            sharded.
        group_placement (`str`): where a step's groups live. ``"spread"``: the batch is split over the processes in
            order and a group may span two of them; rewards are gathered, and the reward's group stage and the
            advantages run on the whole batch. ``"contiguous"``: every group lies on one process (``prompts_per_step``
            must be a multiple of the number of processes); they run on each process's own groups and only the final
            scores and advantages are gathered. Refused with advantages normalised over the whole batch.
        sample_chunks (`int`): each process samples its share of a step in this many consecutive chunks (it must
            divide ``prompts_per_step * group_size / processes``); 1 (the default) samples it in one call. See
            [`mmgrpo.overlapped_scoring`]: each chunk draws its own noise, so the samples differ from one chunk's.
        overlap_scoring (`bool`): with `sample_chunks` > 1, the reward scores each chunk in a worker thread while the
            next chunk samples (the same values as `false`, which scores each chunk right after it is sampled).
        ema (`EMAConfig`, *optional*): ``{decay: 0.9, update_every: 1}``: evaluations, checkpoints and exports use a
            moving average of the trained weights, as Flow-GRPO's and DiffusionNFT's ``train.ema`` (see
            [`mmgrpo.weight_ema`]); unset (the default): the trained weights.
    """

    max_steps: int = 100
    max_seconds: float = 0.0
    async_: AsyncConfig | None = field(default=None, metadata={KEY: "async"})  # the key `async` (a Python keyword)
    prompts_per_step: int = 8
    group_size: int = 8
    minibatch_size: int = 8
    updates_per_step: int = 1
    inner_epochs: int = 1
    learning_rate: float = 3e-4
    weight_decay: float = 1e-4
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    optim: Literal["adamw_torch", "adamw_torch_fused"] = "adamw_torch"
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.1
    prompt_sampling: Literal["uniform", "group_variance", "vas"] = "uniform"
    prompt_sampling_mix: float = 0.5
    vas: VASConfig = field(default_factory=VASConfig)
    max_grad_norm: float = 1.0
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    sharding: Literal["none", "ddp", "fsdp", "hybrid"] = "ddp"
    group_placement: Literal["spread", "contiguous"] = "spread"
    sample_chunks: int = 1
    overlap_scoring: bool = True
    ema: EMAConfig | None = None

    def __post_init__(self):
        check_fields(self)
        if self.sharding in ("fsdp", "hybrid") and self.mixed_precision == "fp16":
            raise ConfigError(f"train.mixed_precision: fp16 does not combine with train.sharding: {self.sharding} "
                              "(sharded fp16 needs a sharded loss scaler): use bf16 (bf16 compute, fp32 reductions) "
                              "or no.")
        values = vars(self)  # field name -> value
        for name, high in SIZE_LIMITS.items():
            check_range(f"train.{name}", values[name], 1, high, fix=SIZE_FIXES.get(name, ""))
        check_range("train.max_seconds", self.max_seconds, 0, SECONDS_LIMIT, fix="0: no time limit")
        check_async(self)
        if self.group_size < 2:
            raise ConfigError("train.group_size must be >= 2: group-relative advantages need at least two samples.")
        samples = self.prompts_per_step * self.group_size
        if samples > SAMPLES_LIMIT:
            raise ConfigError(f"train.prompts_per_step x train.group_size = {samples} samples per step, more than any "
                              f"real run ({SAMPLES_LIMIT}): lower train.prompts_per_step or train.group_size.")
        check_range("train.learning_rate", self.learning_rate, 0, 1.0, low_open=True,
                    fix="AdamW steps each weight by about the learning rate (RL runs use 1e-6 to 1e-3)")
        check_range("train.weight_decay", self.weight_decay, 0, 10.0, fix="1e-4 to 0.1 is usual")
        if self.learning_rate * self.weight_decay >= 1:
            raise ConfigError(f"train.weight_decay {self.weight_decay} x train.learning_rate {self.learning_rate} must "
                              "be < 1: AdamW multiplies each weight by 1 - lr x weight_decay every update, which would "
                              "zero or flip it; lower train.weight_decay.")
        if len(self.adam_betas) != 2:
            raise ConfigError(f"train.adam_betas must have two values, got {self.adam_betas}.")
        for i, beta in enumerate(self.adam_betas):
            check_range(f"train.adam_betas[{i}]", beta, 0, 1, high_open=True, fix="AdamW's betas are in [0, 1)")
        check_range("train.adam_eps", self.adam_eps, 1e-30, 1.0, fix="1e-8 is usual; smaller vanishes in float32 and "
                    "turns a zero gradient into 0 / 0")
        check_range("train.warmup_steps", self.warmup_steps, 0, STEPS_LIMIT, fix="0: no warm-up")
        check_range("train.min_lr_ratio", self.min_lr_ratio, 0, 1)
        check_sampling(self)  # train.prompt_sampling_mix, by sampling
        check_range("train.max_grad_norm", self.max_grad_norm, 0, 1e12, low_open=True,
                    fix="1.0 is usual; 1e6 clips nothing")
        check_range("train.sample_chunks", self.sample_chunks, 1, samples,
                    fix="at most prompts_per_step x group_size (one sample per chunk); 1 samples a step in one call")


@dataclass
class EvalConfig:
    """Held-out evaluation.

    Args:
        every (`int`): evaluate every this many steps (and before the first and after the last step); 0 disables.
        every_seconds (`float`): also evaluate each time the training time (as counted by ``train.max_seconds``:
            training steps only) passes a multiple of this many seconds; 0 (the default) disables. For curves over
            wall-clock time, when the number of steps a budget allows is not known in advance. Evaluation happens
            before the first and after the last step when either `every` or `every_seconds` is set.
        num_prompts (`int`): held-out prompts evaluated (one deterministic sample each).
        grid_size (`int`): samples drawn in each `samples/step_*.png` grid.
        metric (`str`): the reward component reported as the headline eval metric (e.g. ``strict``), or
            ``score`` for the reward itself; not ``prompt``, ``n`` or ``reward``, the other columns of
            ``eval/step_*.json``.
        seed (`int`): noise seed of evaluation samples (the same every evaluation).
        rewards (`dict[str, dict]`): other rewards that score the same held-out samples, by name: ``{name:
            {name: <registered reward, defaults to the name>, **its options}}``, each logged as ``eval/<name>/score``
            and ``eval/<name>/<component>`` (see `mmgrpo.eval_rewards`); empty: the trained reward only.
        splits (`list[str]`, *optional*): the held-out splits evaluated, among those the prompt source declares
            (``eval``, the in-distribution one, and e.g. ``ood``; checked before any model loads); unset: all of them.
            ``eval`` is logged as ``eval/<metric>``, another split as ``eval/<split>/<metric>`` (see
            `mmgrpo.evaluation`); each costs one evaluation of `num_prompts` prompts.
    """

    every: int = 10
    every_seconds: float = 0.0
    num_prompts: int = 64
    grid_size: int = 16
    metric: str = "score"
    seed: int = 1234
    rewards: dict[str, dict] = field(default_factory=dict)
    splits: list[str] | None = None

    def __post_init__(self):
        check_fields(self)
        if self.splits is not None and (not self.splits or len(set(self.splits)) < len(self.splits)
                                        or any(not name.strip() or "/" in name for name in self.splits)):
            raise ConfigError(f"eval.splits must list distinct held-out split names without '/' (e.g. [eval, ood]), "
                              f"or be left out for every split the prompt source declares; got {self.splits!r}.")
        check_range("eval.every", self.every, 0, STEPS_LIMIT, fix="0 disables")
        check_range("eval.every_seconds", self.every_seconds, 0, SECONDS_LIMIT, fix="0 disables")
        check_range("eval.num_prompts", self.num_prompts, 1, SAMPLES_LIMIT)
        check_range("eval.grid_size", self.grid_size, 0, 1024, fix="0 draws no grid")
        check_seed("eval.seed", self.seed)
        if not self.metric.strip():
            raise ConfigError("eval.metric must name a reward component, or 'score' for the reward itself; got ''.")
        if self.metric in ("prompt", "n", "reward"):  # the other columns of eval/step_*.json
            raise ConfigError(
                f"eval.metric {self.metric!r} is a column name of eval/step_*.json: name a reward component, or "
                f"'score' for the reward itself."
            )
        from .eval_rewards import eval_reward_specs

        eval_reward_specs(self.rewards)  # each entry's reward and options, checked now


@dataclass
class CheckpointConfig:
    """Atomic checkpoints.

    Args:
        every (`int`): save every this many steps (0: only at the end).
        keep_last (`int`): complete checkpoints kept.
        resume_from (`str`, *optional*): ``"latest"`` (in this output_dir), ``"auto"`` (the latest complete checkpoint
            in this output_dir if there is one, else a fresh start: the same command starts a run and continues it
            after every requeue) or a checkpoint folder.
        keep_best (`str`, *optional*): also keep the checkpoint whose evaluation scored best on this metric, as
            ``metrics.jsonl`` names it (``eval/score``, ``eval/<eval.rewards name>/score``...), in
            ``checkpoints/best/`` (see `mmgrpo.best_checkpoint`); unset keeps none.
        keep_best_mode (`str`): ``"max"`` (higher is better) or ``"min"``.
        warning_signal (`str`, *optional*): a signal that, like SIGTERM, finishes the step, saves a checkpoint and
            exits with 128 + its number: the early warning a cluster scheduler sends before the time limit
            (``"SIGUSR1"`` for SLURM's ``--signal=USR1@300``); see [`mmgrpo.stop_signals`].
        stop_deadline (`float`): seconds after the first stop signal within which the current step must finish;
            past them the run stops at once, as at a second signal (that step's work is lost, the last checkpoint
            kept). 0 (the default): the step always finishes.
    """

    every: int = 0
    keep_last: int = 2
    resume_from: str | None = None
    keep_best: str | None = None
    keep_best_mode: Literal["max", "min"] = "max"
    warning_signal: str | None = None
    stop_deadline: float = 0.0

    def __post_init__(self):
        check_fields(self)
        check_range("checkpoint.every", self.every, 0, STEPS_LIMIT, fix="0 saves only at the end")
        check_range("checkpoint.stop_deadline", self.stop_deadline, 0, SECONDS_LIMIT, fix="0: the step always finishes")
        check_warning_signal(self.warning_signal)
        check_range("checkpoint.keep_last", self.keep_last, 1, 10**6, fix="the newest checkpoint is always kept")
        check_text("checkpoint.resume_from", self.resume_from)
        if self.keep_best is not None and (not self.keep_best.startswith("eval/") or not self.keep_best[5:].strip()):
            raise ConfigError(f"checkpoint.keep_best must name an evaluation metric as metrics.jsonl does, e.g. "
                              f"eval/score or eval/<eval.rewards name>/score, got {self.keep_best!r}.")


WARNING_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGXCPU", "SIGALRM")  # early warnings a scheduler sends


def check_warning_signal(name: str | None) -> None:
    """`name` (``"SIGUSR1"`` or ``"USR1"``) is a signal a scheduler can send as an early warning."""
    if name is not None and (name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}") \
            not in WARNING_SIGNALS:
        raise ConfigError(f"checkpoint.warning_signal must be one of {', '.join(WARNING_SIGNALS)} (SLURM's "
                          f"--signal=USR1@300 sends SIGUSR1), got {name!r}; SIGINT and SIGTERM are handled anyway.")


@dataclass
class SFTConfig:
    """Supervised fine-tuning (``mmgrpo sft``; ``mmgrpo train`` ignores this section). The SFT run takes its sizes and
    optimizer from ``train`` (``max_steps``, ``prompts_per_step`` items per step, ``minibatch_size``, the learning
    rate and its schedule, clipping, precision; one optimizer update per step: ``group_size``, ``updates_per_step``
    and ``inner_epochs`` are RL-only). See [`mmgrpo.sft`].

    Args:
        target_key (`str`): the key of each item's metadata that holds its target completion (a JSONL row's
            ``"completion"`` field; ``vlm_shapes`` writes it with ``with_targets: true``).
        thought_dropout (`float`): TON's thought dropout: the probability that a target's ``<think>...</think>``
            content is replaced by an empty thought, drawn once per item from the run's seed.
        eval_reward (`bool`): at each held-out evaluation (``eval.every``), also sample the held-out prompts
            greedily and score them with the config's reward, as ``mmgrpo train`` evaluates (``eval/score``,
            ``eval/<component>``, per-prompt scores and samples); otherwise only the held-out target loss.
    """

    target_key: str = "completion"
    thought_dropout: float = 0.0
    eval_reward: bool = False

    def __post_init__(self):
        check_fields(self)
        check_text("sft.target_key", self.target_key)
        check_range("sft.thought_dropout", self.thought_dropout, 0, 1, fix="0 keeps every thought, 1 empties all")


TENSOR_PARALLEL_LIMIT = 64  # GPUs one engine spans (tensor parallelism beyond 8 crosses nodes; 64 is far above)
MODEL_LEN_LIMIT = 2**21  # tokens of a prompt and its completion (the longest-context Qwen-VL models take 256k)


@dataclass
class RolloutConfig:
    """What samples the training rollouts (see [`mmgrpo.engines`] and ``docs/distributed.md``).

    Args:
        engine (`str`): ``"local"`` (the default and the reference: the policy's own decode loop), ``"vllm"`` or
            ``"sglang"`` (token pipelines only, e.g. ``qwen_vl``). An engine's log-probs differ from the trainer's
            (other kernels): the algorithm's ``rollout_correction`` decides how the update uses them.
        mode (`str`): ``"colocate"`` (vLLM in the trainer's process, on its GPU: asleep while the trainer updates,
            awake while it samples; the weights copied in after each step) or ``"server"`` (an engine already
            serving at `server_url`; the weights are written to `weights_dir` and the server reloads them after each
            step). SGLang runs as a server only.
        server_url (`str`, *optional*): the server's base address (``http://host:port``), with ``mode: server``.
        weights_dir (`str`, *optional*): a folder the trainer and the server both see, where each step's weights are
            written for the server to reload (``mode: server``); unset: ``<output_dir>/engine_weights``.
        gpu_memory_utilization (`float`): the share of the GPU's memory the colocated vLLM takes for weights and KV
            cache, in (0, 1]; the trainer needs the rest.
        tensor_parallel_size (`int`): GPUs the colocated engine shards the model over.
        max_model_len (`int`): the longest prompt plus completion (tokens) the engine accepts; 0 takes the model's.
        timeout_s (`float`): seconds a server request may take (sampling one batch, a weight reload) before the run
            stops with an error naming the server.
        enforce_eager (`bool`): vLLM without CUDA graphs (slower decoding, faster start, less memory).
        seed (`int`): the colocated engine's sampling seed (each step's requests add the step's draws to it).
    """

    engine: Literal["local", "vllm", "sglang"] = "local"
    mode: Literal["colocate", "server"] = "colocate"
    server_url: str | None = None
    weights_dir: str | None = None
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    max_model_len: int = 0
    timeout_s: float = 600.0
    enforce_eager: bool = False
    seed: int = 0

    def __post_init__(self):
        check_fields(self)
        check_range("rollout.gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True,
                    fix="the colocated engine's share of GPU memory; 0.3 to 0.6 leaves the trainer the rest")
        check_range("rollout.tensor_parallel_size", self.tensor_parallel_size, 1, TENSOR_PARALLEL_LIMIT,
                    fix="GPUs one engine spans (1 to 8 within a node)")
        check_range("rollout.max_model_len", self.max_model_len, 0, MODEL_LEN_LIMIT, fix="0 takes the model's")
        check_range("rollout.timeout_s", self.timeout_s, 0, SECONDS_LIMIT, low_open=True,
                    fix="seconds a server request may take; 600 is usual")
        check_seed("rollout.seed", self.seed)
        check_text("rollout.server_url", self.server_url)
        check_text("rollout.weights_dir", self.weights_dir)
        if self.engine == "sglang" and self.mode == "colocate":
            raise ConfigError("rollout.engine: sglang runs as a server: set rollout.mode: server and "
                              "rollout.server_url (launch line in docs/distributed.md).")
        if self.engine != "local" and self.mode == "server" and not self.server_url:
            raise ConfigError(f"rollout.mode: server needs rollout.server_url (the {self.engine} server's "
                              "http://host:port).")
        if self.server_url and not self.server_url.startswith(("http://", "https://")):
            raise ConfigError(f"rollout.server_url must start with http:// or https://, got {self.server_url!r}.")
        if self.server_url and (self.engine == "local" or self.mode != "server"):
            raise ConfigError("rollout.server_url is read only with rollout.mode: server and a vllm or sglang "
                              "engine: unset it, or set rollout.mode: server.")
