"""Training configuration: one frozen, keyword-only `TrainConfig`, named presets, and
`key=value` overrides from the command line (unknown keys and bad values are errors).

Paper symbols: G = `group_size` (rollouts per prompt), ε_low/ε_high = `eps_low`/`eps_high`
(DAPO clip-higher), β = `kl_coef`, C = `tis_cap` (truncated importance sampling of the sparse
rollout against the dense policy), tau = `tau` (acceptance-rate tail threshold).
c = `dual_clip_c`, T = `temperature`.
Defaults follow the Sparrow release's math GRPO launch script where it gives a value
(G = 8, lr 1e-6, clip 0.2/0.28, low_var_kl with β = 0, entropy 0, top-20 log-probs kept) and
verl's actor defaults where the script relies on them (dual clip c = 3, token-mean).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Mapping, Sequence

from sparrow_jax.run import config_file


_ARROL_KEYS = {"mode": "arrol_mode", "keep_rate": "arrol_keep_rate", "target": "arrol_target",
               "lam": "arrol_lambda", "p_min": "arrol_p_min", "p_max": "arrol_p_max",
               "num_bins": "arrol_bins", "warmup_steps": "arrol_warmup_steps",
               "detect_len": "arrol_detect_len", "head_lr": "arrol_head_lr",
               "steer": "arrol_steer"}


# The keys that take one of a few values (checked by TrainConfig.__post_init__).
_CHOICES = {"lr_schedule": ("constant", "cosine"), "landmark": ("mean", "quest"),
            "landmark_dtype": ("float32", "bfloat16"),
            "loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                         "seq-mean-token-sum-norm"),
            "kl_kind": ("k1", "k2", "k3", "low_var_kl"),
            "distill_kind": ("k3", "reverse_kl_full"),
            "dtype": ("float32", "bfloat16"), "param_dtype": ("float32", "bfloat16"),
            "arith_template": ("boxed", "raw", "padded"),
            "attention_backend": ("auto", "xla", "pallas", "pallas_interpret", "pallas_tpu",
                                  "pallas_tpu_interpret", "cpu"),
            "cpu_decode_weights": ("", "float32", "bfloat16"),
            "kv_cache_dtype": ("", "float32", "bfloat16"),
            "page_scorer": ("auto", "xla")}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  # model
  model: str = "tiny"  # ModelConfig preset (architecture when model_path is set too)
  model_path: str | None = None  # HF safetensors dir or .gguf file; None = random init
  dtype: str = "float32"
  param_dtype: str = "float32"
  seed: int = 0
  # data and rewards
  data: str = "synthetic:arithmetic"  # or a local .jsonl / .parquet file
  prompt_key: str | None = None
  answer_key: str = "answer"
  chat_template: bool = True
  arith_min_digits: int = 1
  arith_max_digits: int = 2
  arith_ops: str = "+-"
  arith_template: str = "boxed"
  num_examples: int = 2000  # synthetic set size
  reward: str = "boxed_exact"
  reward_timeout_s: float = 10.0  # per completion; a verifier past it is killed, reward 0
  reward_workers: int = 4  # verifier processes, kept for the whole run
  overlong_buffer: int = 0  # DAPO soft overlong penalty buffer in tokens (0 = off)
  # rollout (sparse actor)
  prompts_per_step: int = 8
  group_size: int = 8  # G
  max_prompt_len: int = 512
  max_new_tokens: int = 1024
  temperature: float = 1.0  # T: also divides the logits of every training-side log-prob
  top_p: float = 1.0  # sampling only: training log-probs use the full tempered distribution
  top_k: int = 0  # sampling only, like top_p (0 = off); applied before top_p, as vLLM does
  ignore_eos: bool = False  # rollouts always run to max_new_tokens (vLLM's ignore_eos)
  schedule: str = "dense"  # preset name | JSON path | constant:K | dense
  page_size: int = 16
  landmark: str = "mean"
  landmark_dtype: str = "float32"  # float32 | bfloat16: page landmarks in the KV cache
  dense_layers: str = ""  # comma-separated layers kept dense ("" = the schedule's own, 0,1)
  attention_backend: str = "auto"  # auto | xla | pallas | pallas_tpu | cpu (C++ kernels) | ..._interpret
  # CPU only: the rollout decode's projections and LM head through the C++ matmul
  # (sparrow_jax.cpu_kernels) on a packed copy of the weights in this dtype: float32 (same
  # products) | bfloat16 (half the bytes per step, rounded weights); "" = XLA's products.
  cpu_decode_weights: str = ""
  # The rollout engine's KV cache dtype (vLLM's kv_cache_dtype): "" = the model's compute
  # dtype | float32 | bfloat16 (a float32 model's rollouts over a bf16 cache: half the pool's
  # bytes per token, K/V rounded; the memory plan and the compile report size it so).
  kv_cache_dtype: str = ""
  # How a decode step scores pages: auto (the Triton page-score kernel with the Triton
  # backends, XLA otherwise) | xla (always XLA's gather and scores).
  page_scorer: str = "auto"
  num_slots: int = 64  # concurrent sequences per device (each device runs its own engine shard)
  decode_chunk: int = 16
  # Tokens one prefill call may process per device (rows x padded length; vLLM's
  # max_num_batched_tokens); 0 = every admitted prompt at once. Bounds the prefill's memory.
  max_prefill_tokens: int = 0
  kv_cache_gb: float = 0.0  # KV pool per device; 0 = from the memory plan (kv_cache_fraction)
  kv_cache_fraction: float = 0.9  # of the device memory the plan leaves after everything else
  # optimisation (dense policy)
  num_steps: int = 100
  lr: float = 1e-6
  lr_schedule: str = "constant"  # constant | cosine
  warmup_steps: int = 0
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  adam_eps: float = 1e-8
  ppo_epochs: int = 1
  mini_batch_size: int = 0  # sequences per optimizer update; 0 = the whole batch
  micro_batch_size: int = 0  # sequences per forward/backward (gradient accumulation); 0 = mini
  logprob_micro_batch_size: int = 0  # sequences per no-grad forward (recompute, probe); 0 = micro
  # Length-grouped micro-batches by a per-device token budget (verl's use_dynamic_bsz /
  # ppo_max_token_len_per_gpu): rollouts sorted by length, packed into micro-batches of at
  # most this many padded tokens per device, each padded to its own length bucket. 0 = off
  # (micro-batches of micro_batch_size rows, still length-sorted and bucketed).
  max_tokens_per_micro_batch: int = 0
  logprob_max_tokens_per_micro_batch: int = 0  # the no-grad phases' budget; 0 = the above
  length_buckets_per_octave: int = 8  # padded lengths per power of two (compiled shapes)
  # JAX's persistent compilation cache: programs compiled once are read back by later runs,
  # resumes and evaluations with the same shapes (e.g. every arm of a study shares the
  # update's programs). "" = off (JAX's default).
  compile_cache_dir: str = ""
  skip_redundant_recompute: bool = True  # one optimizer step per batch: reuse its forward
  release_kv_cache: bool = True  # free the rollout's KV pool while the trainer runs
  remat: bool = False  # recompute each layer in the backward pass (long sequences)
  eps_low: float = 0.2
  eps_high: float = 0.28
  dual_clip_c: float | None = 3.0  # c; null turns the dual clip off
  loss_agg: str = "token-mean"
  normalize_adv_std: bool = True  # False = Dr.GRPO
  adv_estimator: str = "grpo"  # grpo | rloo (rl/advantages.py)
  kl_coef: float = 0.0
  kl_kind: str = "low_var_kl"
  entropy_coeff: float = 0.0
  tis_cap: float | None = None  # C
  tis_mask_threshold: float | None = None
  # Lower bound of the TIS mask's kept band (null = 1 / tis_mask_threshold; needs the threshold)
  tis_mask_low: float | None = None
  # Rollout correction (verl's keys; docs/rollout_correction.md; exclusive with tis_*).
  # IS weights on the loss: null | token (rho_t = pi_old/pi_rollout) | sequence (prod_t rho_t)
  # | geometric (exp(mean_t log rho_t))
  rollout_is: str | None = None
  # IS bound: "C" truncates the weights at C; "lo_hi" (e.g. 0.5_5.0) is IcePop: weights
  # outside [lo, hi] set to 0, tokens kept in the mask
  rollout_is_threshold: str = "2.0"
  rollout_is_batch_normalize: bool = False  # divide the IS weights by their mini-batch mean
  # Rejection: comma-separated statistics, each drops tokens or whole sequences outside its
  # threshold: token | sequence | geometric (ratio bands), token_k1/k2/k3, seq_sum_k1/k2/k3,
  # seq_mean_k1/k2/k3, seq_max_k2/k3 (KL(pi_rollout || pi_old) estimators); null = none
  rollout_rs: str | None = None
  # One per rollout_rs statistic (or one for all), comma-separated: "hi" (ratios: kept in
  # [1/hi, hi]; k2/k3: <= hi; k1: |k1| <= hi) or "lo_hi" (kept in [lo, hi])
  rollout_rs_threshold: str | None = None
  # Sparse-RL's sparsity-aware rejection: drop a sequence with any rho_t < this (e.g. 1e-4)
  rollout_token_veto_threshold: float | None = None
  # decoupled: three policies, rho against the dense recompute; bypass: pi_old = pi_rollout
  # (no recompute; the PPO ratio is pi_theta / pi_rollout; rollout_rs then uses sg(pi_theta))
  rollout_mode: str = "decoupled"
  dynamic_sampling: bool = False
  max_refill_rounds: int = 4  # extra rollout rounds to refill dropped groups (0 = no refill)
  max_bad_steps: int = 3  # NaN/inf steps in a row before the run stops
  # Asynchronous off-policy training (issue 47; docs/training_step.md, "Asynchronous steps").
  max_staleness: int = 0  # N: a step trains on tokens at most N policy versions old; 0 = sync
  partial_rollouts: bool = False  # unfinished sequences continue under the new weights
  partial_rollout_kv: str = "keep"  # keep | recompute: the running sequences' KV at an update
  rollout_devices: int = 0  # K devices for the engine apart from the learner (0 = time-share)
  async_overlap: bool = False  # with rollout_devices: the engine decodes while the learner trains
  logprob_chunk: int = 128
  # supervised warm start (random-init models only need it)
  warmstart_steps: int = 0
  warmstart_lr: float = 3e-3
  warmstart_batch: int = 32
  # DistillSparse (sparse-actor LoRA)
  distill: bool = False
  lora_rank: int = 8
  lora_alpha: float = 16.0
  lora_targets: str = "q,k,v,o,gate,up,down"
  distill_lr: float = 1e-4
  distill_warmup_steps: int = 10  # linear LoRA lr warm-up: Adam's first steps are full-size
  distill_coef: float = 1.0
  distill_kind: str = "k3"  # k3 | reverse_kl_full
  distill_pg_coef: float = 0.0  # weight of the LoRA's own policy-gradient term (0 = off)
  distill_pg_clip: float | None = 2.0  # C: its importance ratio truncated at C (null: none)
  # No LoRA step while the batch's largest |dense - sparse actor| log-prob gap is below this:
  # the actor equals the policy up to float32 rounding (~1e-6 here), the gradient is noise
  # and Adam would turn it into full-size steps (0 = always step; raise it for bfloat16;
  # not applied with distill_pg_coef > 0, whose term has the advantages' signal).
  distill_min_gap: float = 1e-4
  # ARRoL: online rollout pruning with a learned quality head (issue 11, rl/arrol.py)
  arrol: bool = False
  arrol_mode: str = "head"  # head | random (ablation: prune at the same keep rate at random)
  arrol_keep_rate: float = 0.5  # kappa: expected fraction of a group's scored rollouts kept
  arrol_target: float = 0.5  # rho: target positive ratio among kept rollouts (authors: 0.4)
  arrol_detect_len: int = 512  # L_detect: generated tokens before the keep/prune decision
  arrol_lambda: float = 0.5  # lambda: steering strength
  arrol_p_min: float = 0.25
  arrol_p_max: float = 0.75
  arrol_bins: int = 128  # calibration bins of the head score
  arrol_warmup_steps: int = 20  # steps without pruning while the head learns
  arrol_head_lr: float = 0.01  # Adam on the head (authors' code)
  arrol_steer: str = "paper"  # paper | signed (see rl/arrol.py: the paper's rule and ours)
  # Multi-turn tool use (issue 49, sparrow_jax/agents): "" = single-turn rollouts
  tools: str = ""  # comma-separated: calculator, python
  # qwen3 (<tool_call>{json}</tool_call>) | plain (<tool NAME TEXT>) | plain_padded
  tool_format: str = "qwen3"
  max_turns: int = 4  # policy turns per trajectory (a call in the last one is not run)
  max_tool_response_tokens: int = 256  # each tool response cut to this many tokens
  tool_timeout_s: float = 5.0  # the Python tool's wall-clock limit per call
  tool_demo_frac: float = 0.5  # warm-start demonstrations that call the tool (synthetic task)
  # a system message before every prompt: "" none, "tools" the tools' description and call
  # format (agents/tasks.py tool_system_prompt; for templates that ignore tools=), else this text
  system_prompt: str = ""
  # mismatch monitor and schedule ladder
  monitor_topk: int = 20
  mismatch_bin_size: int = 2048
  tau: float = 0.86
  ladder: str = ""  # comma-separated schedules after `schedule`, most aggressive last
  ladder_patience: int = 3
  probe_every: int = 5
  probe_min_count: int = 32  # tokens a position bin needs to count in the ladder probe
  # Every N steps (0 = off), the exact alpha tail per position bin of the rollout actor vs the
  # dense policy, teacher-forced on the step's first `exact_alpha_rows` rollouts (0 = all):
  # mismatch/exact_p5[_bin_i], the value the monitor's top-k statistic bounds from below.
  exact_alpha_every: int = 0
  exact_alpha_rows: int = 8
  # checkpoints, logging, sharding
  out_dir: str = "runs/default"
  save_every: int = 10  # and always at the end (and on Ctrl-C); 0 = only at the end
  keep_last: int = 3
  export_hf: bool = False
  export_dtype: str | None = None  # float32 | bfloat16 | float16; None = param_dtype
  mesh: str = "data=1,fsdp=-1,tensor=1"
  tensorboard: bool = True  # false removes tensorboard from `logger`
  logger: str = "tensorboard"  # comma-separated: tensorboard, wandb (optional), none
  wandb_project: str = "sparrow_jax"
  sample_every: int = 10  # log completions (prompt, response, reward) every N steps; 0 = off
  samples_per_log: int = 4
  val_data: str | None = None  # held-out .jsonl/.parquet (or synthetic:arithmetic) for val/*
  val_every: int = 0  # validate every N steps and at the end; 0 = only at the end
  val_k: int = 4  # samples per validation prompt (avg@k, pass@k)
  val_max_prompts: int = 0  # 0 = all
  # Memory per device a dry run plans for; 0 = this machine's (an accelerator's own, on CPU
  # the host's available RAM). The GPU presets plan for an H200 (141). A real run checks
  # against the memory it really has (an accelerator's limit; on CPU the host RAM).
  device_memory_gb: float = 0.0

  def __post_init__(self):
    pos_int = ("prompts_per_step", "group_size", "max_prompt_len", "max_new_tokens",
               "page_size", "num_slots", "decode_chunk", "ppo_epochs", "max_bad_steps",
               "logprob_chunk", "warmstart_batch", "lora_rank", "monitor_topk",
               "mismatch_bin_size", "keep_last", "ladder_patience", "probe_every",
               "num_examples", "reward_workers", "probe_min_count", "samples_per_log",
               "val_k")
    for f in pos_int:
      v = getattr(self, f)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"{f}={v!r}: expected a positive integer")
    for f in ("num_steps", "warmup_steps", "warmstart_steps", "save_every", "mini_batch_size",
              "micro_batch_size", "logprob_micro_batch_size", "max_tokens_per_micro_batch",
              "logprob_max_tokens_per_micro_batch", "overlong_buffer", "distill_warmup_steps",
              "max_refill_rounds", "distill_pg_coef", "sample_every", "val_every",
              "exact_alpha_every", "exact_alpha_rows",
              "val_max_prompts"):
      if getattr(self, f) < 0:
        raise ValueError(f"{f}={getattr(self, f)!r}: expected >= 0")
    if self.group_size < 2:
      raise ValueError(f"group_size={self.group_size}: GRPO needs at least 2 samples per prompt")
    if self.mini_batch_size and (self.prompts_per_step * self.group_size) % self.mini_batch_size:
      raise ValueError(f"mini_batch_size={self.mini_batch_size} must divide "
                       f"prompts_per_step*group_size={self.prompts_per_step * self.group_size}")
    if self.micro_batch_size and self.mini_batch % self.micro_batch_size:
      raise ValueError(f"micro_batch_size={self.micro_batch_size} must divide the mini-batch "
                       f"of {self.mini_batch} sequences")
    seq = self.max_prompt_len + self.max_new_tokens
    for f in ("max_tokens_per_micro_batch", "logprob_max_tokens_per_micro_batch"):
      v = getattr(self, f)
      if v and v < seq:
        raise ValueError(f"{f}={v}: expected 0 (off) or at least max_prompt_len + "
                         f"max_new_tokens = {seq} tokens (one sequence of the maximum length)")
    if self.length_buckets_per_octave not in (1, 2, 4, 8, 16, 32):
      raise ValueError(f"length_buckets_per_octave={self.length_buckets_per_octave!r}: "
                       "expected one of 1, 2, 4, 8, 16, 32")
    for f in ("lr", "warmstart_lr", "distill_lr"):
      if not getattr(self, f) > 0:
        raise ValueError(f"{f}={getattr(self, f)!r}: expected > 0")
    if not 0 < self.tau < 1:
      raise ValueError(f"tau={self.tau}: expected in (0, 1)")
    if self.device_memory_gb < 0:
      raise ValueError(f"device_memory_gb={self.device_memory_gb}: expected >= 0 (0 = this "
                       "machine's)")
    if self.kv_cache_gb < 0:
      raise ValueError(f"kv_cache_gb={self.kv_cache_gb}: expected >= 0 (0 = from the memory "
                       "plan)")
    if self.max_prefill_tokens < 0:
      raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens}: expected >= 0 "
                       "(0 = no limit)")
    if not 0 < self.kv_cache_fraction <= 1:
      raise ValueError(f"kv_cache_fraction={self.kv_cache_fraction}: expected in (0, 1]")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p}: expected in (0, 1]")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k}: expected >= 0 (0 = off)")
    _check_trainable(self)
    _check_async(self)
    if self.dual_clip_c is not None and not self.dual_clip_c > 1:
      raise ValueError(f"dual_clip_c={self.dual_clip_c!r}: expected null (off) or > 1")
    if self.arrol:
      if self.arrol_detect_len < 1 or self.arrol_detect_len >= self.max_new_tokens:
        raise ValueError(f"arrol_detect_len={self.arrol_detect_len}: expected 1 <= L_detect < "
                         f"max_new_tokens={self.max_new_tokens} (pruning decides on a prefix)")
      if self.dynamic_sampling:
        raise ValueError("arrol=true with dynamic_sampling=true: not supported yet (DAPO's "
                         "refill assumes groups of group_size; ARRoL prunes inside groups)")
      try:  # ArrolConfig validates the ranges and names the field
        self.arrol_config()
      except ValueError as e:  # name the TrainConfig key, not the ArrolConfig field
        msg = str(e)
        for field, key in _ARROL_KEYS.items():
          msg = msg.replace(f"ArrolConfig.{field}=", f"{key}=")
        raise ValueError(msg) from None
    if isinstance(self.distill_min_gap, bool) or not isinstance(
        self.distill_min_gap, (int, float)) or not self.distill_min_gap >= 0:
      raise ValueError(f"distill_min_gap={self.distill_min_gap!r}: expected a float >= 0 "
                       "(0 = every batch updates the LoRA)")
    if self.distill_pg_clip is not None and not self.distill_pg_clip > 0:
      raise ValueError(f"distill_pg_clip={self.distill_pg_clip!r}: expected null or > 0")
    if self.distill_coef < 0 or (self.distill_coef == 0 and self.distill_pg_coef == 0):
      raise ValueError(f"distill_coef={self.distill_coef!r}, distill_pg_coef="
                       f"{self.distill_pg_coef!r}: expected >= 0, at least one > 0")
    if not self.reward_timeout_s > 0:
      raise ValueError(f"reward_timeout_s={self.reward_timeout_s!r}: expected > 0 seconds")
    for f, ok in _CHOICES.items():
      if getattr(self, f) not in ok:
        raise ValueError(f"{f}={getattr(self, f)!r}: expected one of {ok}")
    if self.export_dtype not in (None, "float32", "bfloat16", "float16"):
      raise ValueError(f"export_dtype={self.export_dtype!r}: expected float32, bfloat16, "
                       "float16 or none (= param_dtype)")
    _check_tools(self)
    bad = [x for x in self.loggers if x not in LOGGERS]
    if bad or not self.logger.strip():
      raise ValueError(f"logger={self.logger!r}: expected a comma-separated subset of "
                       f"{LOGGERS} (or 'none')")

  @property
  def loggers(self) -> tuple[str, ...]:
    """Logging backends beside the console and metrics.jsonl (`tensorboard=false` drops
    TensorBoard whatever `logger` says)."""
    out = tuple(x.strip() for x in self.logger.split(",") if x.strip() and x.strip() != "none")
    return tuple(x for x in out if x != "tensorboard" or self.tensorboard)

  def arrol_config(self):
    """The `rl.arrol.ArrolConfig` these `arrol_*` keys describe."""
    from sparrow_jax.rl.arrol import ArrolConfig
    return ArrolConfig(**{field: getattr(self, key) for field, key in _ARROL_KEYS.items()})

  @property
  def batch_size(self) -> int:
    return self.prompts_per_step * self.group_size

  @property
  def mini_batch(self) -> int:
    return self.mini_batch_size or self.batch_size

  @property
  def micro_batch(self) -> int:
    return self.micro_batch_size or self.mini_batch

  @property
  def samples_unfiltered(self) -> bool:
    """Sampling draws from the whole tempered distribution (no top-p / top-k filter), so the
    engine's sampled-token log-probs are those a teacher-forced forward recomputes."""
    return self.top_p >= 1.0 and self.top_k == 0

  @property
  def skips_recompute(self) -> bool:
    """The dense recompute is redundant: one optimizer step per rollout batch (one epoch,
    one mini-batch), so the old log-probs equal the update's own forward under
    stop_gradient (verl skips it too). It is kept when something needs the old log-probs
    before the update: DistillSparse's teacher, or the TIS mask / decoupled rollout
    rejection that shapes the loss's denominators, or the IS batch normaliser."""
    decoupled_pre = self.rollout_mode == "decoupled" and (
        self.rollout_rs is not None or self.rollout_token_veto_threshold is not None
        or self.rollout_is_batch_normalize)
    return (self.skip_redundant_recompute and self.ppo_epochs == 1
            and self.mini_batch == self.batch_size and not self.distill
            and self.tis_mask_threshold is None and not decoupled_pre)

  @property
  def kv_pool_released(self) -> bool:
    """The engine's KV pool is freed while the learner runs: `release_kv_cache`, and never
    under asynchronous training (the running sequences keep their pages across steps) nor
    with `rollout_devices` (the pool is on the engine's own devices: freeing it gives the
    learner nothing)."""
    return self.release_kv_cache and not self.max_staleness and not self.rollout_devices

  def replace(self, **kw) -> "TrainConfig":
    return dataclasses.replace(self, **kw)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


LOGGERS = ("tensorboard", "wandb")


def _check_trainable(cfg: TrainConfig) -> None:
  """Settings under which GRPO cannot learn, refused up front (issue 50)."""
  if isinstance(cfg.num_steps, int) and cfg.num_steps == 0:
    raise ValueError("num_steps=0: expected at least 1 (a run trains at least one GRPO step; "
                     "`--dry-run` plans a config without training)")
  if cfg.temperature < 0:
    raise ValueError(f"temperature={cfg.temperature}: expected > 0")
  if cfg.temperature == 0:
    raise ValueError(f"temperature=0: greedy sampling makes all group_size={cfg.group_size} "
                     "rollouts of a prompt identical, so every advantage is 0 and GRPO learns "
                     "nothing (and training log-probs divide by T); expected > 0, e.g. 1.0 "
                     "(greedy decoding is for eval.py / generate.py --temperature 0)")


def _check_async(cfg: TrainConfig) -> None:
  """The asynchronous keys (issue 47), refused where they cannot work, with why."""
  n = cfg.max_staleness
  if isinstance(n, bool) or not isinstance(n, int) or n < 0:
    raise ValueError(f"max_staleness={n!r}: expected an int >= 0 (0 = synchronous steps)")
  if cfg.partial_rollout_kv not in ("keep", "recompute"):
    raise ValueError(f"partial_rollout_kv={cfg.partial_rollout_kv!r}: expected keep or "
                     "recompute")
  if cfg.partial_rollouts and not n:
    raise ValueError("partial_rollouts=true needs max_staleness >= 1 (with 0 every sequence "
                     "finishes under the weights it started with: synchronous steps)")
  k = cfg.rollout_devices
  if isinstance(k, bool) or not isinstance(k, int) or k < 0:
    raise ValueError(f"rollout_devices={k!r}: expected an int >= 0 (K of the process's "
                     "devices for the engine, the rest for the learner; 0 = time-share them)")
  if cfg.async_overlap and not (n and k):
    raise ValueError(
        f"async_overlap=true needs max_staleness >= 1 and rollout_devices >= 1 (got "
        f"max_staleness={n}, rollout_devices={k}): the engine decodes on its own devices "
        "while the learner trains on the rest, and what it samples then is one version old")
  if n and cfg.dynamic_sampling:
    raise ValueError(f"max_staleness={n} with dynamic_sampling=true: not supported (DAPO's "
                     "refill rounds regenerate within one step; asynchronous steps take "
                     "whichever groups finish)")
  if n and cfg.arrol:
    raise ValueError(f"max_staleness={n} with arrol=true: not supported (ARRoL decides a "
                     "group's pruning inside one synchronous rollout)")
  if n and cfg.val_every:
    raise ValueError(f"max_staleness={n} with val_every={cfg.val_every}: validation mid-run "
                     "would generate in the KV pool the rollout session's running sequences "
                     "hold; use val_every=0 (validation at the end only)")


_GPU = dict(dtype="bfloat16", param_dtype="float32", data="", max_prompt_len=2048,
            max_new_tokens=32768, group_size=8, prompts_per_step=32, num_slots=64,
            lr=1e-6, eps_low=0.2, eps_high=0.28, kl_coef=0.0, entropy_coeff=0.0,
            reward="math_verify", mini_batch_size=64, micro_batch_size=2, remat=True,
            # Micro-batches by tokens per device (verl's ppo_max_token_len_per_gpu): two
            # sequences at the longest context, more when they are shorter, on any mesh.
            max_tokens_per_micro_batch=69632,
            tis_cap=2.0, num_steps=500, device_memory_gb=141.0,
            save_every=20, monitor_topk=20, mismatch_bin_size=2048, tau=0.86,
            # Landmarks in bf16, as the cache: on an H200 a sparse layer's step (scoring + top-k
            # + kernel) is 20-27% shorter at batch 64 x 32K, and on SmolLM2 the exact alpha's
            # mean and p5 move by <= 0.002 (BENCHMARKS.md, "Landmark dtype").
            landmark_dtype="bfloat16",
            # 16 prompts of 2K tokens per prefill call: a bounded prefill (the pool gets the
            # rest) that still fills the GPU.
            max_prefill_tokens=32768,
            # The pool takes 80% of what the rollout phase leaves (not 90%): the margin holds
            # the XLA decode path too (attention_backend=xla gathers the selected pages), so
            # the step XLA compiles for these shapes (--dry-run --compile) fits with >= 5%
            # headroom, and on the GPU it covers library workspaces.
            kv_cache_fraction=0.8)

def _check_tools(cfg: TrainConfig) -> None:
  """The multi-turn keys (issue 49)."""
  if cfg.system_prompt == "tools" and not cfg.tools:
    raise ValueError("system_prompt=tools describes the tools: set tools= too (e.g. "
                     "tools=calculator)")
  if not cfg.tools:
    return
  names = [n.strip() for n in cfg.tools.split(",") if n.strip()]
  known = ("calculator", "python")
  if not names or any(n not in known for n in names):
    raise ValueError(f"tools={cfg.tools!r}: expected a comma-separated subset of {known}")
  if cfg.tool_format not in ("qwen3", "plain", "plain_padded"):
    raise ValueError(f"tool_format={cfg.tool_format!r}: expected qwen3, plain or plain_padded")
  for f in ("max_turns", "max_tool_response_tokens"):
    if getattr(cfg, f) < 1:
      raise ValueError(f"{f}={getattr(cfg, f)!r}: expected a positive integer")
  if not cfg.tool_timeout_s > 0:
    raise ValueError(f"tool_timeout_s={cfg.tool_timeout_s!r}: expected > 0 seconds")
  if not 0 <= cfg.tool_demo_frac <= 1:
    raise ValueError(f"tool_demo_frac={cfg.tool_demo_frac!r}: expected in [0, 1]")
  if cfg.arrol:
    raise ValueError("tools with arrol=true: not supported (ARRoL's detection length and "
                     "its engine hook count one uninterrupted generation)")
  if getattr(cfg, "max_staleness", 0):
    raise ValueError("tools with max_staleness > 0: not supported yet (the agent loop runs "
                     "its turns as synchronous engine calls)")


# Per-model memory knobs on top of _GPU, where a preset's step compiled for its devices
# (`--dry-run --compile`) needs them to fit with >= 5% headroom. None today: at _GPU's
# kv_cache_fraction=0.8 qwen3_4b on 4 H200s, qwen3_8b on 8 and qwen3_14b on 16 keep 12.5%,
# 11.2% and 8.2% (BENCHMARKS.md, "Qwen3 presets compiled, the compile report without
# XLA:CPU's float32 weight copy", 2026-12-05). 4B / 8B had 0.75 / 0.6 while the report
# counted XLA:CPU's hoisted float32 copy of the rollout weights in the decode chunk.
_GPU_MEMORY: dict[str, dict] = {}

PRESETS: dict[str, TrainConfig] = {
    # The embedded default: random-init tiny Qwen3 + byte tokenizer, a supervised warm start
    # on single-digit arithmetic, then GRPO on sparse rollouts with DistillSparse on. The
    # sequences are ~9 tokens, so pages of 2 tokens make the schedule (1 top-k page + 1 bos
    # + 2 recent, layer 0 dense) really sparse. Finishes in minutes on a laptop CPU.
    "tiny": TrainConfig(
        model="tiny", arith_min_digits=1, arith_max_digits=1, arith_ops="+",
        arith_template="raw", num_examples=32, reward="exact_match", prompts_per_step=16,
        group_size=8, max_prompt_len=32, max_new_tokens=4, temperature=1.0,
        schedule="constant:1", page_size=2, dense_layers="0", num_slots=128, decode_chunk=4,
        num_steps=60, lr=1e-3, warmup_steps=0, max_grad_norm=1.0, warmstart_steps=60,
        warmstart_lr=3e-3,
        warmstart_batch=32, distill=True, lora_rank=4, distill_lr=3e-4,
        out_dir="runs/tiny", tensorboard=True, mismatch_bin_size=8, monitor_topk=8,
        probe_every=4, arrol_detect_len=1, arrol_warmup_steps=10),
    # Multi-turn tool use (issue 49): 4-6 digit sums and products, which the tiny model
    # cannot compute but can copy into a calculator call (`<tool calculator 1234*5678    >`)
    # and copy the result (`<result 7006652         >`) into its answer. The expression and
    # the result sit in fixed-width fields (arith_template=padded, tool_format=plain_padded),
    # so both copies are fixed-offset attention patterns a 2-layer model learns in a few
    # hundred steps (unpadded: ~3% right after 750 warm-start steps). The warm start shows the
    # tool on half of its demonstrations; GRPO rewards the exact answer.
    "tiny_tools": TrainConfig(
        model="tiny", arith_min_digits=4, arith_max_digits=6, arith_ops="+*",
        arith_template="padded", num_examples=2000, reward="exact_match", prompts_per_step=16,
        group_size=8, max_prompt_len=32, max_new_tokens=80, temperature=1.0,
        schedule="constant:4", page_size=4, dense_layers="0", num_slots=128, decode_chunk=8,
        num_steps=40, lr=1e-3, max_grad_norm=1.0, warmstart_steps=500, warmstart_lr=3e-3,
        warmstart_batch=32, tools="calculator", tool_format="plain_padded", max_turns=2,
        max_tool_response_tokens=16, tool_demo_frac=0.5, out_dir="runs/tiny_tools",
        mismatch_bin_size=16, monitor_topk=8, sample_every=10),
    "smollm2_135m": TrainConfig(
        model="smollm2_135m", arith_min_digits=1, arith_max_digits=2, arith_template="boxed",
        reward="boxed_exact", prompts_per_step=4, group_size=4, max_prompt_len=128,
        max_new_tokens=64, schedule="constant:4", num_slots=16, num_steps=10, lr=1e-6,
        out_dir="runs/smollm2_135m", mismatch_bin_size=512,
        # CPU-sized: layers recomputed in the backward pass, micro-batches of at most 4K
        # tokens (the update then needs ~2 GB beside the weights at any response length).
        remat=True, max_tokens_per_micro_batch=4096),
    # The real-model study on a 2-core CPU (issues 20, 22): responses of up to 256 tokens,
    # 16 rollouts a step, 40 steps; a step is ~15-25 s here (one update over the step's
    # tokens in micro-batches of <= 4K tokens, remat; the redundant recompute is skipped).
    # The task is what this model can half do (issue 20's pre-check: avg@4 0.2-0.6): the
    # Q4_1 135M model at T=1 writes noise and boxes <10% of its answers, at T=0.7 it gets
    # ~0.4 of 1-digit problems right in prose, 0.09 of 1-2 digit ones; hence 1-digit + - *,
    # T=0.7 and a reward that takes the boxed answer or else the last number.
    "smollm2_135m_study": TrainConfig(
        model="smollm2_135m", arith_min_digits=1, arith_max_digits=1, arith_ops="+-*",
        arith_template="boxed", reward="boxed_or_last_number", temperature=0.7,
        # Its answers run to 30-60 tokens after a ~47-token prompt: pages of 4 tokens give
        # such a sequence ~20-25 pages, so a budget of a few pages is really sparse here (at
        # 16 it would be 5-6 pages, nearly dense); position bins of 32 tokens.
        prompts_per_step=4, group_size=4, max_prompt_len=128, page_size=4,
        max_new_tokens=256, schedule="constant:4", num_slots=16, num_steps=40, lr=1e-5,
        out_dir="runs/smollm2_135m_study", mismatch_bin_size=32, save_every=10,
        # Two length buckets per octave: fewer compiled update shapes (each ~10-20 s here).
        remat=True, max_tokens_per_micro_batch=4096, length_buckets_per_octave=2),
    **{name: TrainConfig(model=name, schedule=sched, out_dir=f"runs/{name}",
                         **{**_GPU, **_GPU_MEMORY.get(name, {})})
       for name, sched in [("qwen3_0p6b", "qwen3-1.7b-0.86"), ("qwen3_1p7b", "qwen3-1.7b-0.86"),
                           ("qwen3_4b", "qwen3-4b-0.86"), ("qwen3_8b", "qwen3-8b-0.86"),
                           ("qwen3_14b", "qwen3-14b-0.86")]},
}


def _parse_value(field: dataclasses.Field, raw: str):
  tp = typing.get_type_hints(TrainConfig)[field.name]
  args = typing.get_args(tp)
  if type(None) in args:
    if raw.lower() in ("none", "null", ""):
      return None
    tp = next(a for a in args if a is not type(None))
  base = tp
  if base is bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
      return True
    if low in ("0", "false", "no", "off"):
      return False
    raise ValueError(f"{field.name}={raw!r}: expected a boolean (true/false)")
  if base is int:
    try:
      return int(raw)
    except ValueError:
      raise ValueError(f"{field.name}={raw!r}: expected an integer") from None
  if base is float:
    try:
      return float(raw)
    except ValueError:
      raise ValueError(f"{field.name}={raw!r}: expected a number") from None
  return raw


def close_keys(key: str, known) -> list[str]:
  """Close spellings of `key` among `known` (difflib), best first."""
  return difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)


def unknown_key_message(key: str, known) -> str:
  """"unknown config key 'num_step' (did you mean num_steps?)" and where the keys are listed;
  the whole list of ~100 keys would bury the suggestion."""
  close = close_keys(key, known)
  hint = f" (did you mean {close[0]}?)" if close else ""  # the closest only: one clear hint
  return (f"unknown config key {key!r}{hint}; `python experiments/train.py --list-keys` lists "
          "every key with its type and default")


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
  """Parse `key=value` strings into typed TrainConfig field values."""
  fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
  out = {}
  for item in items:
    if "=" not in item:
      raise ValueError(f"override {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    key = key.strip().replace("-", "_")
    if key not in fields:
      raise ValueError(unknown_key_message(key, fields))
    out[key] = _parse_value(fields[key], raw.strip())
  return out


def get_train_config(name: str, overrides: Sequence[str] = ()) -> TrainConfig:
  """A preset by name, or a YAML/JSON config file (`run/config_file.py`; a run's own
  config.json too), with `key=value` overrides on top."""
  if name not in PRESETS and config_file.is_config_file(name):
    return config_file.load_config_file(name, parse_overrides(overrides),
                                        config_cls=TrainConfig, presets=PRESETS,
                                        parse_value=_parse_value, close_keys=close_keys)
  if name not in PRESETS:
    raise ValueError(f"unknown training preset {name!r}; valid presets: {sorted(PRESETS)} "
                     "(or a .yaml/.json config file)")
  return PRESETS[name].replace(**parse_overrides(overrides))


def config_from_dict(d: Mapping[str, Any], *, where: str = "saved config") -> TrainConfig:
  """A TrainConfig from `to_dict()` output (a run's config.json or checkpoint metadata).

  Unknown keys are an error (a config written by a newer version, or a different file);
  keys missing from `d` take today's defaults.
  """
  if not isinstance(d, Mapping):
    raise ValueError(f"{where}: expected a JSON object of TrainConfig fields, got "
                     f"{type(d).__name__}")
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  unknown = sorted(set(d) - fields)
  if unknown:
    close = {k: close_keys(k, fields) for k in unknown}
    hint = "".join(f" ({k}: did you mean {c[0]}?)" for k, c in close.items() if c)
    raise ValueError(f"{where}: unknown config keys {unknown}{hint}; expected TrainConfig "
                     "fields")
  return TrainConfig(**dict(d))
