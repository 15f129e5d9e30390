"""The meaning of every `TrainConfig` key, one entry per field: what `--list-keys` prints and
what `docs/config.md` is generated from (`python -m sparrow_jax.run.config_help --write`).

Kept apart from `config.py` so the dataclass stays a list of fields and defaults. A test checks
that every field has an entry here (and nothing else does): a new key without a meaning fails
it. Where the Sparrow paper, verl or TRL name the same setting, the entry says so
(`paper: G`, `verl: actor.clip_ratio_low`, `TRL: num_generations`).
"""

from __future__ import annotations

KEY_DOCS: dict[str, str] = {
    # model
    "model": "Architecture preset (ModelConfig: tiny, smollm2_135m, qwen3_0p6b ... qwen3_14b); "
             "with model_path set, the checkpoint's own config.json decides the shapes.",
    "model_path": "Weights: a local HF safetensors directory or a .gguf file; `random` = the "
                  "preset's shapes with random weights and a byte tokenizer (benchmarks and "
                  "dry runs only; vLLM's load_format=dummy); null = random init (tiny only).",
    "dtype": "Compute dtype of the forward passes and the rollout engine (float32 | bfloat16).",
    "param_dtype": "Dtype the trained parameters and Adam moments are stored in.",
    "seed": "Seed of model init, data order, sampling and the synthetic task.",
    # data / reward
    "data": "Training prompts: `synthetic:arithmetic` or a local .jsonl / .parquet file "
            "(experiments/prepare_data.py converts GSM8K, MATH and verl parquet).",
    "prompt_key": "Field of a record holding the prompt (text or chat messages); dotted paths "
                  "walk nested records; null tries `prompt`, then `question`.",
    "answer_key": "Field holding the ground truth the reward compares against; dotted paths "
                  "walk nested records (verl parquet: reward_model.ground_truth).",
    "chat_template": "Wrap each prompt in the tokenizer's chat template (when it has one).",
    "arith_min_digits": "Synthetic arithmetic: fewest digits of an operand.",
    "arith_max_digits": "Synthetic arithmetic: most digits of an operand.",
    "arith_ops": "Synthetic arithmetic: the operators drawn from, e.g. `+-*`.",
    "arith_template": "Synthetic arithmetic prompt: `boxed` (asks for \\boxed{}), `raw` "
                      "(`8+6=` -> `14`, what a byte-level tiny model can learn) or `padded` "
                      "(`raw` with the expression left-aligned in a fixed-width field: a "
                      "tool call repeats it at a fixed distance; tiny_tools).",
    "num_examples": "Synthetic arithmetic: number of distinct prompts generated.",
    "reward": "Verifier: math_verify | boxed_exact | boxed_or_last_number | exact_match, a "
              "registered name, `module:function` or `file.py:function` (verl: "
              "reward_model / custom_reward_function; TRL: reward_funcs).",
    "reward_timeout_s": "Seconds a verifier may spend on one completion; past it the worker "
                        "is killed and the completion scores 0.",
    "reward_workers": "Verifier processes kept for the whole run.",
    "overlong_buffer": "DAPO's soft overlong penalty: the last N tokens before max_new_tokens "
                       "are penalised linearly (0 = off; verl: overlong_buffer.len).",
    # rollout
    "prompts_per_step": "Prompts per step (N); the batch is N x group_size rollouts (verl: "
                        "data.train_batch_size).",
    "group_size": "Rollouts per prompt (paper: G; verl: rollout.n; TRL: num_generations); "
                  "at least 2.",
    "max_prompt_len": "Prompts longer than this many tokens are dropped, with a count "
                      "(verl: data.max_prompt_length).",
    "max_new_tokens": "Longest response in tokens (verl: data.max_response_length; TRL: "
                      "max_completion_length).",
    "temperature": "Sampling temperature (paper: T); also divides the logits of every "
                   "training-side log-prob. Must be > 0 for training (0 = greedy: identical "
                   "rollouts, no GRPO signal).",
    "top_p": "Nucleus sampling mass (sampling only: training log-probs use the full tempered "
             "distribution).",
    "top_k": "Top-k sampling (0 = off); applied before top_p, as vLLM does.",
    "ignore_eos": "Rollouts always run to max_new_tokens (vLLM's ignore_eos; benchmarks).",
    "schedule": "Sparsity schedule of the rollout actor: a preset name (e.g. "
                "qwen3-1.7b-0.86), a JSON file, `constant:K` (K top-k pages everywhere) or "
                "`dense`.",
    "page_size": "Tokens per KV page (the unit of block-sparse selection).",
    "landmark": "Page summary used to score pages: mean (key centroid) | quest (per-channel "
                "min/max bounds).",
    "landmark_dtype": "Dtype of the page landmarks in the KV cache (float32 | bfloat16).",
    "dense_layers": "Comma-separated layers kept dense (\"\" = the schedule's own, e.g. 0,1).",
    "attention_backend": "Rollout attention kernels: auto | xla | pallas | pallas_tpu | cpu "
                         "(C++ kernels) | pallas_interpret | pallas_tpu_interpret.",
    "cpu_decode_weights": "CPU only: decode projections and LM head through the C++ matmul "
                          "on packed weights in this dtype (float32 | bfloat16); \"\" = XLA.",
    "kv_cache_dtype": "Rollout KV cache dtype (vLLM's kv_cache_dtype): \"\" = the compute "
                      "dtype | float32 | bfloat16.",
    "page_scorer": "How a decode step scores pages: auto (the Triton page-score kernel with "
                   "the Triton backends) | xla.",
    "num_slots": "Concurrent sequences per device in the rollout engine (vLLM: max_num_seqs).",
    "decode_chunk": "Decode steps run per engine call between scheduling decisions.",
    "max_prefill_tokens": "Tokens one prefill call may process per device (vLLM: "
                          "max_num_batched_tokens); 0 = every admitted prompt at once.",
    "kv_cache_gb": "KV pool per device in GB; 0 = from the memory plan (kv_cache_fraction).",
    "kv_cache_fraction": "Share of the device memory left after everything else that the KV "
                         "pool takes (vLLM: gpu_memory_utilization, applied to the rest).",
    "release_kv_cache": "Free the rollout's KV pool while the trainer updates (verl: "
                        "free_cache_engine).",
    # policy update
    "num_steps": "GRPO steps to train (at least 1; the warm start is extra).",
    "lr": "Adam learning rate of the policy (verl: actor.optim.lr; TRL: learning_rate).",
    "lr_schedule": "constant | cosine (cosine decays to 0.1 x lr after the warm-up).",
    "warmup_steps": "Linear learning-rate warm-up steps (0 = none).",
    "weight_decay": "AdamW weight decay.",
    "max_grad_norm": "Global gradient-norm clip (verl: actor.grad_clip; TRL: max_grad_norm).",
    "adam_eps": "Adam's epsilon (the denominator's floor).",
    "ppo_epochs": "Passes over each rollout batch (verl: actor.ppo_epochs; TRL: "
                  "num_iterations).",
    "mini_batch_size": "Sequences per optimizer update; 0 = the whole batch (verl: "
                       "ppo_mini_batch_size, counted in sequences here).",
    "micro_batch_size": "Sequences per forward/backward (gradient accumulation); 0 = the "
                        "mini-batch (verl: ppo_micro_batch_size_per_gpu).",
    "remat": "Recompute each layer in the backward pass (less memory, more compute; verl: "
             "enable_gradient_checkpointing).",
    "eps_low": "Lower PPO clip (paper: ε_low; verl: clip_ratio_low; TRL: epsilon).",
    "eps_high": "Upper PPO clip, DAPO clip-higher (paper: ε_high; verl: clip_ratio_high; "
                "TRL: epsilon_high).",
    "dual_clip_c": "Dual-clip bound for negative advantages (paper: c; verl: clip_ratio_c); "
                   "null = off.",
    "loss_agg": "Loss aggregation: token-mean | seq-mean-token-mean | seq-mean-token-sum | "
                "seq-mean-token-sum-norm (verl: loss_agg_mode).",
    "adv_estimator": "Advantage estimator by name (rl/advantages.py; verl: "
                     "algorithm.adv_estimator): grpo = group-relative (r - group mean) / group "
                     "std; rloo = r minus the mean of the group's other rewards "
                     "(normalize_adv_std does not apply).",
    "normalize_adv_std": "Divide advantages by the group's reward std (false = Dr.GRPO; verl: "
                         "norm_adv_by_std_in_grpo; TRL: scale_rewards).",
    "kl_coef": "KL penalty weight against the initial policy (paper: β; verl: kl_loss_coef; "
               "TRL: beta); 0 = no reference model.",
    "kl_kind": "KL estimator: k1 | k2 | k3 | low_var_kl (verl: kl_loss_type).",
    "entropy_coeff": "Entropy bonus weight (verl: entropy_coeff).",
    "tis_cap": "Truncated importance sampling of the sparse rollout against the dense policy: "
               "the ratio capped at C (paper: C; verl: tis_imp_ratio_cap); null = off.",
    "tis_mask_threshold": "h > 1: tokens whose dense/sparse ratio lies outside [1/h, h] are "
                          "masked out of the loss; null = off.",
    "tis_mask_low": "Lower bound of the TIS mask's kept band (null = 1 / tis_mask_threshold; "
                    "0 = none; needs the threshold).",
    # rollout correction (issue 48; docs/rollout_correction.md has every formula)
    "rollout_is": "IS weights on the loss (verl: rollout_is): token (rho_t = pi_old / "
                  "pi_rollout), sequence (prod_t rho_t) or geometric (exp(mean_t log rho_t)); "
                  "null = off. Exclusive with tis_cap / tis_mask_threshold.",
    "rollout_is_threshold": "IS bound (verl: rollout_is_threshold): \"C\" truncates the "
                            "weights at C; \"lo_hi\" (e.g. 0.5_5.0) is IcePop: weights outside "
                            "[lo, hi] set to 0, the tokens stay in the mask.",
    "rollout_is_batch_normalize": "Divide the IS weights by their mean over the mini-batch "
                                  "(tokens, or sequences for sequence/geometric) (verl: "
                                  "rollout_is_batch_normalize).",
    "rollout_rs": "Rejection sampling (verl: rollout_rs): comma-separated statistics, each "
                  "drops tokens or whole sequences outside its threshold: token, sequence, "
                  "geometric (ratio bands); token_k1/k2/k3, seq_sum_k1/k2/k3, "
                  "seq_mean_k1/k2/k3, seq_max_k2/k3 (KL(pi_rollout || pi_old) estimators); "
                  "null = off.",
    "rollout_rs_threshold": "One threshold per rollout_rs statistic (or one for all), "
                            "comma-separated: \"hi\" (ratio kept in [1/hi, hi]; k2/k3 <= hi; "
                            "|k1| <= hi) or \"lo_hi\" (kept in [lo, hi]; verl's lower_upper).",
    "rollout_token_veto_threshold": "Sparse-RL's sparsity-aware rejection (verl: "
                                    "rollout_token_veto_threshold): drop a sequence if any "
                                    "token has rho_t below this (e.g. 1e-4); null = off.",
    "rollout_mode": "decoupled: three policies, the corrections use pi_old / pi_rollout; "
                    "bypass: pi_old = pi_rollout (no recompute, the PPO ratio is pi_theta / "
                    "pi_rollout; rollout_rs uses sg(pi_theta) / pi_rollout) (verl: "
                    "bypass_mode).",
    "dynamic_sampling": "DAPO dynamic sampling: drop zero-variance groups and refill the batch "
                        "(verl: algorithm.filter_groups).",
    "max_refill_rounds": "Extra rollout rounds to refill dropped groups (0 = no refill; verl: "
                         "filter_groups.max_num_gen_batches).",
    "max_staleness": "N of asynchronous training (verl: async_training.staleness_threshold; "
                     "AReaL: max_head_offpolicyness): the engine generates ahead of the "
                     "learner and a step trains only on tokens sampled at most N policy "
                     "versions ago; 0 = synchronous steps, bit-identical to before. With N > "
                     "0 and no correction key set, tis_cap=2 is applied (decoupled PPO's "
                     "behaviour weight pi_prox / mu, capped); single-process runs only.",
    "partial_rollouts": "With max_staleness > 0: sequences still running when a step has its "
                        "groups keep their slots and pages and continue under the new "
                        "weights (verl / slime partial_rollout); false: the engine admits "
                        "nothing new until they finish under the old weights (one version "
                        "per sequence).",
    "partial_rollout_kv": "What the running sequences' KV does at a weight update with "
                          "partial_rollouts: keep (TRL's pause keep: no cost, the recorded "
                          "log-probs stay the behaviour policy's) | recompute (AReaL: "
                          "re-prefill every running context under the new weights).",
    "rollout_devices": "K devices of the process for the engine (the last K), the rest for "
                       "the learner's mesh; after each update the policy (and the actor's "
                       "LoRA) is copied to the engine's devices (async/weight_sync_s). 0 = "
                       "engine and learner time-share every device. One process only: a "
                       "multi-host run refuses K > 0.",
    "async_overlap": "With rollout_devices and max_staleness > 0: the engine keeps decoding on "
                     "its devices (a thread) while the learner's stages run on theirs, "
                     "stopping before the new weights are published; the tokens it samples "
                     "then are of the version being trained on (staleness >= 1 when trained). "
                     "Which version samples a token then depends on timing: runs are not "
                     "bit-reproducible (async/overlap_chunks, async/overlap_s).",
    "max_bad_steps": "NaN/inf steps in a row before the run stops.",
    "logprob_chunk": "Positions per LM-head chunk when log-probs are computed (bounds the "
                     "[positions x vocab] logits in memory).",
    # micro-batches
    "logprob_micro_batch_size": "Sequences per no-grad forward (recompute, probe); 0 = "
                                "micro_batch_size (verl: log_prob_micro_batch_size_per_gpu).",
    "max_tokens_per_micro_batch": "Length-grouped micro-batches of at most this many padded "
                                  "tokens per device; 0 = by rows (verl: use_dynamic_bsz + "
                                  "ppo_max_token_len_per_gpu).",
    "logprob_max_tokens_per_micro_batch": "The no-grad phases' token budget; 0 = "
                                          "max_tokens_per_micro_batch (verl: "
                                          "log_prob_max_token_len_per_gpu).",
    "length_buckets_per_octave": "Padded lengths per power of two (1-32): fewer = fewer "
                                 "compiled shapes, more padding.",
    "skip_redundant_recompute": "Reuse the update's own forward as the old log-probs when one "
                                "optimizer step covers the batch (verl does too).",
    # warm start
    "warmstart_steps": "Supervised steps on the data's prompt -> answer pairs before RL (the "
                       "tiny preset: 60, so a random-init model earns rewards); 0 = none.",
    "warmstart_lr": "Learning rate of the supervised warm start.",
    "warmstart_batch": "Examples per warm-start step.",
    # DistillSparse
    "distill": "DistillSparse: train a LoRA used only by the sparse actor, distilled from the "
               "dense log-probs (needs a sparse schedule).",
    "lora_rank": "LoRA rank (r).",
    "lora_alpha": "LoRA scale numerator (alpha / r scales the update).",
    "lora_targets": "Projections that get a LoRA: any of q,k,v,o,gate,up,down.",
    "distill_lr": "Adam learning rate of the LoRA.",
    "distill_warmup_steps": "Linear LoRA learning-rate warm-up steps.",
    "distill_coef": "Weight of the distillation loss.",
    "distill_kind": "Distillation loss: k3 (sampled-token estimator) | reverse_kl_full (exact "
                    "over the vocabulary).",
    "distill_pg_coef": "Weight of the LoRA's own policy-gradient term (0 = off).",
    "distill_pg_clip": "That term's importance ratio truncated at C (null = none).",
    "distill_min_gap": "No LoRA step while the batch's largest dense/sparse log-prob gap is "
                       "below this (rounding noise; 0 = always step).",
    # ARRoL
    "arrol": "ARRoL online rollout pruning with a learned quality head (rl/arrol.py).",
    "arrol_mode": "head | random (ablation: prune at the same keep rate at random).",
    "arrol_keep_rate": "Expected fraction of a group's scored rollouts kept (κ).",
    "arrol_target": "Target positive ratio among kept rollouts (ρ).",
    "arrol_detect_len": "Generated tokens before the keep/prune decision (L_detect).",
    "arrol_lambda": "Steering strength (λ).",
    "arrol_p_min": "Lowest keep probability.",
    "arrol_p_max": "Highest keep probability.",
    "arrol_bins": "Calibration bins of the head score.",
    "arrol_warmup_steps": "Steps without pruning while the head learns.",
    "arrol_head_lr": "Adam learning rate of the quality head.",
    "arrol_steer": "paper | signed: the steering rule (rl/arrol.py explains both).",
    # multi-turn tool use
    "tools": "Tools of multi-turn rollouts, comma-separated: calculator (exact integer and "
             "rational arithmetic) | python (a sandboxed process); empty = single-turn "
             "rollouts (sparrow_jax/agents; verl: actor_rollout_ref.rollout.multi_turn).",
    "tool_format": "How a turn calls a tool: qwen3 (`<tool_call>{json}</tool_call>` and the "
                   "chat template's `<tool_response>` turn) | plain (`<tool NAME TEXT>` -> "
                   "`<result TEXT>`, for byte-tokenizer models) | plain_padded (plain, each "
                   "response left-aligned in a field of max_tool_response_tokens characters, "
                   "so a tiny model copies it with a fixed-offset attention; tiny_tools).",
    "max_turns": "Policy turns per trajectory; a call in the last turn is not executed "
                 "(verl: multi_turn.max_assistant_turns).",
    "max_tool_response_tokens": "Each tool response is cut to this many tokens before it "
                                "enters the context (verl: multi_turn.max_tool_response_length).",
    "tool_timeout_s": "Wall-clock seconds the Python tool may run per call; past it the "
                      "process group is killed and the model gets a timeout error.",
    "tool_demo_frac": "Share of the warm start's synthetic demonstrations that call the tool "
                      "(the others answer directly).",
    "system_prompt": "A system message put before every prompt (chat templates render it; the "
                     "byte tokenizer joins it with a newline): \"\" none, \"tools\" the tools' "
                     "description and one call in tool_format's exact format "
                     "(agents/tasks.py tool_system_prompt: for chat templates that ignore "
                     "tools=, e.g. SmolLM2's), any other text as is.",
    # monitor / ladder
    "monitor_topk": "Top-k log-probs the sampler keeps for the acceptance-rate monitor (the "
                    "release keeps 20).",
    "mismatch_bin_size": "Tokens per position bin of the acceptance-rate monitor.",
    "tau": "Threshold the lower tail (p5) of the acceptance rate alpha_t is held above "
           "(paper: tau), in (0, 1).",
    "ladder": "Comma-separated schedules after `schedule`, most aggressive last; the run "
              "moves along it while the monitor allows.",
    "ladder_patience": "Probes in a row that must pass before the ladder moves on.",
    "probe_every": "Steps between ladder probes.",
    "probe_min_count": "Tokens a position bin needs to count in a ladder probe.",
    "exact_alpha_every": "Every N steps the exact alpha tail per bin, teacher-forced "
                         "(mismatch/exact_p5*); 0 = off.",
    "exact_alpha_rows": "Rollouts of the step the exact alpha uses (0 = all).",
    # run
    "out_dir": "Run directory: metrics.jsonl, samples.jsonl, tb/, checkpoints/, config.json, "
               "summary.json.",
    "save_every": "Checkpoint every N steps, always at the end and on Ctrl-C (0 = only at the "
                  "end; verl: save_freq).",
    "keep_last": "Checkpoints kept (the newest).",
    "export_hf": "At the end, also write an HF safetensors directory out_dir/hf.",
    "export_dtype": "Dtype of that export: float32 | bfloat16 | float16; null = param_dtype.",
    "mesh": "Device mesh, e.g. data=2,fsdp=4,tensor=1 (-1 = the remaining devices).",
    "compile_cache_dir": "JAX's persistent compilation cache directory (\"\" = off): resumes "
                         "and runs with the same shapes skip compiling.",
    "device_memory_gb": "Memory per device a dry run plans for; 0 = this machine's.",
    # logging / validation
    "logger": "Comma-separated logging backends beside the console and metrics.jsonl: "
              "tensorboard, wandb, none.",
    "tensorboard": "false removes tensorboard from `logger`.",
    "wandb_project": "Weights & Biases project (logger=wandb).",
    "sample_every": "Log completions (prompt, response, reward) every N steps; 0 = off.",
    "samples_per_log": "Completions per sample log.",
    "val_data": "Held-out .jsonl/.parquet (or synthetic:arithmetic) scored as val/*.",
    "val_every": "Validate every N steps and at the end; 0 = only at the end.",
    "val_k": "Samples per validation prompt (avg@k, pass@k).",
    "val_max_prompts": "Validation prompts used (0 = all).",
}
