"""Shared defaults: every field of a jaxgrpo run, with a one-line comment each.

Other configs import this module, call ``get_config()`` and override fields. The schema (which
keys exist and their types) is this file: ``jaxgrpo.settings.schema.validate`` rejects anything
else.
"""

from ml_collections import ConfigDict, FieldReference

# The judge's default user message (eval.judge_prompt), filled in per completion.
JUDGE_PROMPT = (
    "Question:\n{question}\n\nReference answer: {reference}\n\nStudent's solution:\n"
    "{completion}\n\nDoes the student's solution reach the reference answer? "
    "Reply with one word: yes or no."
)


def _model() -> ConfigDict:
    c = ConfigDict()
    # HF dir, hub id, .gguf path, "smollm2" (embedded GGUF), "tiny" (random), random:<name>, or a
    # run directory (its latest checkpoint, LoRA merged; a LoRA policy gets fresh adapters)
    c.source = "smollm2"
    c.dtype = "float32"  # compute dtype: "float32" or "bfloat16"
    c.param_dtype = "float32"  # parameter storage dtype: "float32" or "bfloat16"
    c.remat = True  # recompute each block in the backward pass: keeps one input per layer, not
    # its activations (the update's largest buffers), for one more forward pass of FLOPs
    # what remat keeps besides each block's input: "full" nothing; "projections" the outputs of
    # its projections, so none is recomputed (a faster update for more memory: two to three
    # times a LoRA run's memory per device at gsm8k_hard's sizes; `jaxgrpo.planning.memory` says
    # what fits)
    c.remat_policy = "full"
    # "scan", "unroll" or "auto" (unroll for full fine-tuning on CPU without remat)
    c.layer_loop = "auto"
    c.lora_rank = 16  # LoRA rank R; 0 = full fine-tuning of every parameter
    c.lora_alpha = 32.0  # LoRA scale numerator: adapter output is scaled by alpha / rank
    c.lora_targets = ("q", "k", "v", "o", "gate", "up", "down")  # projections that get adapters
    return c


def _task() -> ConfigDict:
    c = ConfigDict()
    c.name = "format_copy"  # task name for jaxgrpo.data.get_task
    c.prompt_template = ""  # prompt template name or text; "" = the task's default
    c.system_prompt = ""  # system message; "" = the task's default
    c.num_eval = 64  # held-out prompts scored (strict accuracy) before and after training
    c.kwargs = ConfigDict()  # extra keyword arguments for get_task (set keys in a config file)
    return c


def _rewards() -> ConfigDict:
    c = ConfigDict()
    # (name, weight[, kwargs]): weight a float or a curriculum dict (jaxgrpo.rewards.Curriculum:
    # kind constant/linear/step/cosine, start, end, start_step, end_step); kwargs bound to the fn.
    # A name that is a directory or hub id "org/name" is a reward model (kwargs: batch_size,
    # max_length); () only with a teacher's distillation term
    c.functions = (("format_copy", 1.0),)
    c.reward_on_error = "none"  # a reward fn that raises: "none" scores None, "raise" stops the run
    c.max_failed_steps = 3  # stop once a reward fn fails every sample of this many steps in a row
    # user reward fns get TRL's chat messages (True) or strings (False); "auto": messages where
    # the data's rows are chats (a prompt/messages column of messages), as TRL decides. Typed
    # `object`, so an override may set a bool where the default is a string.
    c.conversational = FieldReference("auto", field_type=object)
    c.timeout_s = 300.0  # a reward fn's call past this many seconds scores its samples None; 0 off
    c.max_memory_gb = 8.0  # ... or once it grows the process by this many GiB; 0 = no limit
    return c


def _schedule() -> ConfigDict:
    c = ConfigDict()
    c.kind = "constant"  # "constant", "linear", "cosine", "exponential" or "piecewise"
    c.end = 1.0  # value reached after `steps` (smooth kinds)
    c.steps = 0  # length in steps (positions); 0 = the run's steps (max_new_tokens)
    c.boundaries = ()  # piecewise: increasing steps (or positions) where the value changes
    c.levels = ()  # piecewise: len(boundaries) + 1 values; levels[i] from boundaries[i - 1] on
    return c


def _sampling() -> ConfigDict:
    c = ConfigDict()
    c.max_new_tokens = 64  # completion length T (a completion that reaches it is "truncated")
    c.temperature = 1.0  # sampling temperature at step 0 (> 0: groups need distinct samples)
    c.temperature_schedule = _schedule()  # temperature over training steps, from `temperature`
    # multiplier of the step's temperature over completion positions (1.0 at position 0)
    c.position_schedule = _schedule()
    c.top_p = 1.0  # nucleus sampling mass; 1.0 = off
    c.top_k = 0  # keep the k most likely tokens; 0 = off (static: changing it recompiles)
    c.min_p = 0.0  # drop tokens below min_p * p(most likely token); 0 = off
    c.repetition_guard = (0, 0)  # (n, k): stop a row whose last n-gram occurred k times; n=0 = off
    c.stop = ()  # stop strings: a row ends at the token completing one (vLLM's `stop`); () = none
    return c


def _rl() -> ConfigDict:
    c = ConfigDict()
    c.prompts_per_step = 4  # B: prompts drawn per training step
    c.group_size = 8  # G: completions sampled per prompt (the batch is B*G sequences)
    c.loss_type = "grpo"  # "grpo", "dapo", "dr_grpo", "gr_reinforce" or "gspo" (rl/losses.py)
    c.eps_low = 0.2  # clip ratio below at 1 - eps_low
    c.eps_high = 0.2  # clip ratio above at 1 + eps_high (> eps_low = DAPO clip-higher)
    c.ratio_cap = 0.0  # cap on the unclipped ratio, min(r, ratio_cap) (TRL's delta); 0 = off
    c.dual_clip = 0.0  # c > 1: the loss of A < 0 tokens is at most -c * A (dual-clip PPO); 0 = off
    c.top_entropy_frac = 0.0  # policy gradient on this fraction of highest-entropy tokens; 0 = all
    c.beta = 0.04  # KL(pi || pi_ref) coefficient; 0 skips the reference pass
    c.kl_estimator = "k3"  # per-token KL estimator: "k1", "k2" or "k3"
    c.kl_in_reward = False  # subtract beta * KL from the reward instead of adding it to the loss
    # multiply the per-token KL by the importance ratio (TRL's use_bias_correction_kl, on by
    # default in TRL 1.16; it changes the KL gradient even on-policy, where the ratio is 1)
    c.kl_bias_correction = False
    # advantage scaling: "group" std (GRPO), "batch" std, "none", or "auto": the loss preset's
    # ("none" for dr_grpo, "group" for the others)
    c.adv_scale = "auto"
    c.baseline = "mean"  # advantage baseline: "mean" of the group, or "rloo" (leave-one-out)
    c.ppo_epochs = 1  # optimisation passes over each sampled batch
    c.num_minibatches = 1  # optimizer updates per epoch (the batch is split into this many)
    c.grad_accum = 1  # micro-batches accumulated per optimizer update (exact global normaliser)
    # more micro-batches than grad_accum when one would score over this many token columns
    # (packed rows x width) per device, so the update's activations stop growing with the
    # completions' length; -1 = auto (4096 on CPU hosts; off on TPU/GPU, where
    # `python -m jaxgrpo.memory` sizes grad_accum ahead of the run); 0 = off
    c.micro_batch_columns = -1
    c.mask_truncated = False  # exclude completions that hit max_new_tokens from the loss
    c.pack_completions = True  # score a group's completions end to end in one row (less padding)
    c.share_prompt_prefix = True  # score the tokens all prompts begin with once per batch
    c.dynamic_sampling = False  # drop zero-variance groups and draw more prompts to refill (DAPO)
    c.dynamic_sampling_max_draws = 3  # cap on sampling rounds per step for dynamic sampling
    c.ref_reset_every = 0  # every N steps the reference becomes the current policy; 0 = never
    c.ref_reset_optimizer = False  # also reset the optimizer state at a reference reset
    c.entropy_coef = 0.0  # entropy bonus coefficient (0 = off)
    c.tis_cap = 0.0  # truncated importance-sampling cap on sampler/trainer ratio; 0 = off
    # Asynchronous rollouts (rl/pipeline.py): the policy versions a batch may be behind the
    # learner (TRL's AsyncGRPOTrainer name); 0 = the synchronous loop, 1 = one step off
    c.max_staleness = 0
    # how the lag is bounded: "wait" (the sampler samples batch n with the weights of step
    # n - max_staleness, waiting for them: reproducible) or "drop" (it samples with the newest
    # weights it has and the learner drops batches older than max_staleness)
    c.stale_batches = "wait"
    # the loss's correction for the lag, with r = pi_learner / pi_sampler per token: "clip"
    # (PPO's clip of r itself: the trust region is around the policy that sampled), "mask"
    # (weight r inside [lag_floor, lag_cap], 0 outside: IcePop) or "tis" (the clip against the
    # learner's policy, weight min(r, lag_cap): decoupled PPO, for several updates per step)
    c.lag_correction = "clip"
    c.lag_cap = 2.0  # "tis"'s truncation and "mask"'s upper edge (>= 1)
    c.lag_floor = 0.5  # "mask"'s lower edge (in (0, 1])
    return c


def _optim() -> ConfigDict:
    c = ConfigDict()
    c.lr = 1e-5  # peak learning rate (AdamW)
    c.warmup_steps = 0  # linear warmup from 0 to lr over this many training steps
    c.schedule = "cosine"  # after warmup: "cosine" decay to 0 or "constant"
    c.weight_decay = 0.0  # AdamW decoupled weight decay
    c.b1 = 0.9  # Adam first-moment decay
    c.b2 = 0.999  # Adam second-moment decay
    c.eps = 1e-8  # Adam epsilon, added to the root of the second moment (TRL: adam_epsilon)
    c.max_grad_norm = 1.0  # global-norm gradient clipping; 0 = off
    return c


def _mesh() -> ConfigDict:
    c = ConfigDict()
    c.data = -1  # data-parallel axis size; -1 = fill with the remaining devices
    c.fsdp = 1  # fully-sharded data-parallel axis size (parameters sharded, batch split)
    c.tensor = 1  # tensor-parallel axis size (heads / mlp split)
    c.coordinator_address = ""  # jax.distributed coordinator "host:port"; "" = env / auto (TPU)
    c.num_processes = 0  # processes (hosts); 0 = from env (else 1), -1 = JAX discovers (TPU pods)
    c.process_id = -1  # this process's index; -1 = env / auto
    # devices of their own for the sampler (the slice's last N; the learner's mesh gets the
    # rest), holding a copy of the weights refreshed after every update; needs
    # rl.max_staleness >= 1; 0 = the sampler shares the learner's devices
    c.sampler_devices = 0
    return c


def _checkpoint() -> ConfigDict:
    c = ConfigDict()
    c.every = 50  # save every N steps (and always at exit); 0 = only at exit
    c.keep = 3  # keep the last K checkpoints
    return c


def _logging() -> ConfigDict:
    c = ConfigDict()
    c.every = 1  # write metrics every N steps
    c.samples_every = 10  # write sample completions every N steps; 0 = never
    c.tensorboard = True  # also write TensorBoard event files (tensorboardX)
    c.wandb = False  # also log to Weights & Biases (when installed)
    c.wandb_project = "jaxgrpo"  # W&B project name
    c.progress = True  # show a progress bar
    return c


def _eval() -> ConfigDict:
    c = ConfigDict()
    # held-out evaluation during training (greedy, sampling.max_new_tokens) every N steps, as
    # well as before the first and after the last step; 0 = only before and after
    c.every = 0
    c.num_samples = 8  # completions per held-out prompt (pass@k for every k <= num_samples)
    c.max_new_tokens = 512  # completion length at evaluation (the seed study's 512)
    c.temperature = 0.6  # sampling temperature at evaluation; 0 = greedy (then use 1 sample)
    c.top_p = 0.95  # nucleus sampling mass at evaluation; 1.0 = off
    c.batch_size = 8  # prompts per generate call (fixed shape: compiles once)
    c.judge_source = ""  # judge model (any load_model source, e.g. an HF dir); "" = no judge
    c.judge_prompt = JUDGE_PROMPT  # judge's user message: {question}, {reference}, {completion}
    return c


def _agent() -> ConfigDict:
    c = ConfigDict()
    # tool functions by dotted name ("my_pkg.tools.search"), TRL's `tools=[...]`: each one's
    # schema comes from its type hints and its docstring's Args section
    c.tools = ()
    # a class (or factory) by dotted name, TRL's `environment_factory`: one instance per
    # episode; its public methods are tools, reset(**row) (the example's prompt and columns) may
    # add to the prompt and get_reward() scores the episode; "" = none
    c.environment = ""
    # TRL's dict environment_factory: name -> dotted name, picked by each example's `environment`
    c.environments = ConfigDict()
    c.environment_reward_weight = 1.0  # weight of the environment's get_reward(); 0 = not used
    c.max_turns = 4  # model turns per episode at most (TRL's max_tool_calling_iterations + 1)
    c.max_tool_tokens = 256  # a tool result longer than this many tokens is cut (and counted)
    c.tool_timeout_s = 10.0  # a tool call past this many seconds returns a timeout error
    # how calls are written: "auto" (the chat template's: Qwen's <tool_call> JSON, Llama 3.1's
    # JSON turn; else jaxgrpo's <tool_call> JSON in any ChatML template), "json", "llama3", or
    # "tag" (<calc>3*4</calc> answered by <result>12</result> in the same turn; one-argument tools)
    c.format = "auto"
    return c


def _teacher() -> ConfigDict:
    c = ConfigDict()
    # a frozen teacher scoring every sampled token (any model.source: HF dir, .gguf, "smollm2",
    # a run directory's latest checkpoint with its LoRA merged); its tokenizer must be the
    # policy's; "" = no teacher
    c.source = ""
    # on-policy distillation: the advantage of each model token gains
    # coef * (log p_teacher - log p_student), stop-gradient (the per-token reverse KL); 0 = off
    c.distill_coef = 0.0
    # the KL penalty (rl.beta, rl.kl_estimator, rl.kl_in_reward) is toward the teacher in
    # place of the reference policy (no reference pass then)
    c.as_reference = False
    return c


def get_config() -> ConfigDict:
    """Returns the full default config (every field present)."""
    c = ConfigDict()
    c.run_dir = "runs/default"  # outputs: metrics, samples, checkpoints, TensorBoard
    c.seed = 0  # seeds parameters (random models / LoRA), sampling and data order
    c.steps = 100  # training steps (each: sample, score, update)
    c.resume = True  # continue from run_dir's latest checkpoint if any; False = fail if one exists
    c.model = _model()  # which model and adapters
    c.task = _task()  # prompts and held-out set
    c.rewards = _rewards()  # reward functions and weights
    c.sampling = _sampling()  # the sampler's knobs
    c.rl = _rl()  # objective and batch layout
    c.optim = _optim()  # AdamW and its schedule
    c.mesh = _mesh()  # device mesh and hosts
    c.checkpoint = _checkpoint()  # orbax checkpoints
    c.logging = _logging()  # metrics, samples, progress
    c.eval = _eval()  # held-out evaluation: during training, and python -m jaxgrpo.evaluate
    c.agent = _agent()  # tools and environments: episodes of several turns (none by default)
    c.teacher = _teacher()  # a second, frozen model: distillation term or KL target (off)
    return c
