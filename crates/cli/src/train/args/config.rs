//! The configuration of a run, built once: defaults, then the `--config` TOML file, then the
//! flags — a Hugging Face model to start from (`--init-from`), the architecture preset and the
//! block options, the vocabulary sized to the tokenizer — and the data files they name.

use super::*;

pub(super) fn off_or<T: std::str::FromStr>(field: &str, value: &str) -> Result<Option<T>> {
    if value == "off" || value == "none" {
        return Ok(None);
    }
    value.parse::<T>().map(Some).map_err(|_| anyhow::anyhow!("invalid --{field}: '{value}' (expected a number or 'off')"))
}

/// The `--config` file's training settings: the file without the tables of commands (a
/// deployment's one file may hold `[agent]` for its agents; `[controller]` is refused where
/// the command is not `lazarus controller`, which reads it itself).
pub(super) fn config_text(args: &TrainArgs, path: &Path) -> Result<String> {
    let text = crate::io::read_text("config", path, 1 << 20)?;
    let mut table: toml::Table = toml::from_str(&text).with_context(|| format!("invalid --config {}", path.display()))?;
    if table.contains_key("controller") && !args.model.config_tables.contains(&"controller") {
        bail!(
            "invalid --config {}: its [controller] table holds `lazarus controller`'s settings, which this command does not use",
            path.display()
        );
    }
    table.remove("controller");
    table.remove("agent");
    Ok(toml::to_string(&table)?)
}

/// The configuration: defaults, then the TOML file, then flags.
pub fn build_config(args: &TrainArgs) -> Result<TrainConfig> {
    // Where a rotary base was said, if anywhere: with learned positions it would do nothing.
    let mut theta_said = args.model.rope_theta.map(|t| format!("--rope-theta {t}"));
    let mut c = match &args.model.config {
        Some(path) => {
            let mut table: toml::Table =
                toml::from_str(&config_text(args, path)?).with_context(|| format!("invalid --config {}", path.display()))?;
            if let Some(t) = table.get("model").and_then(|m| m.get("rope_theta")).filter(|_| theta_said.is_none()) {
                theta_said = Some(format!("rope_theta = {t} in --config {}", path.display()));
            }
            let preset = take_arch(&mut table).with_context(|| format!("invalid --config {}", path.display()))?;
            let mut c = table.try_into::<TrainConfig>().with_context(|| format!("invalid --config {}", path.display()))?;
            if let Some((arch, said)) = preset {
                c.model = with_arch_under(c.model, arch, &said);
            }
            c
        }
        None => TrainConfig::default(),
    };
    apply_flags(args, &mut c)?;
    apply_init_from(args, &mut c)?;
    if let Some(said) = theta_said.filter(|_| c.model.positions != lazarus_model::config::Positions::Rope) {
        bail!("{said}: the model's positions are learned, with no rotary base (--positions rope, or --arch mixtral, uses one)");
    }
    size_vocabulary(args, &mut c)?;
    c.validate()?;
    Ok(c)
}

/// With `--init-from DIR` (or `init_from` in the file) the model is DIR's: each shape and block
/// option taken from it, unless a flag or the file gave another value than the default, which is
/// an error naming it (the training-only settings — aux loss, capacity factor — stay ours).
pub(super) fn apply_init_from(args: &TrainArgs, c: &mut TrainConfig) -> Result<()> {
    if let Some(dir) = &args.init_from {
        c.init_from = Some(dir.clone());
    }
    let Some(dir) = c.init_from.clone() else { return Ok(()) };
    if !lazarus_model::hf::is_hf_dir(&dir) {
        bail!(
            "invalid --init-from: {} holds no config.json beside a model.safetensors or {} (a Hugging Face model directory)",
            dir.display(),
            lazarus_model::hf::INDEX_FILE
        );
    }
    let theirs = lazarus_model::hf::read_config(&dir).context("--init-from")?;
    let default = lazarus_model::ModelConfig::default();
    let ours = &c.model;
    let m = &args.model;
    // A field is said when its flag is given (or --arch, for the block options) or the file
    // gave it another value than the default.
    let blocks = m.arch.is_some();
    macro_rules! first_said_otherwise {
        ($($field:ident => $flag:literal if $given:expr),*) => {
            [$((($given || ours.$field != default.$field) && ours.$field != theirs.$field).then(|| {
                format!("--{} {:?} (the model in {} has {:?})", $flag, ours.$field, dir.display(), theirs.$field)
            })),*].into_iter().flatten().next()
        };
    }
    let clash = first_said_otherwise!(vocab_size => "vocab-size" if m.vocab_size.is_some(), d_model => "d-model" if m.d_model.is_some(),
        n_layers => "layers" if m.layers.is_some(), n_heads => "heads" if m.heads.is_some(), n_experts => "experts" if m.experts.is_some(),
        top_k => "top-k" if m.top_k.is_some(), d_ff => "d-ff" if m.d_ff.is_some(), moe_every => "moe-every" if m.moe_every.is_some(),
        shared_experts => "shared-experts" if blocks || m.shared_experts.is_some(), norm => "norm" if blocks || m.norm.is_some(),
        positions => "positions" if blocks || m.positions.is_some(), expert_act => "expert-act" if blocks || m.expert_act.is_some(),
        attn_bias => "attn-bias" if blocks || m.attn_bias.is_some(), ffn_bias => "ffn-bias" if blocks || m.ffn_bias.is_some(),
        normalize_top_k => "normalize-top-k" if blocks || m.normalize_top_k.is_some(),
        rope_theta => "rope-theta" if blocks || m.rope_theta.is_some(), qk_norm => "qk-norm" if blocks || m.qk_norm.is_some(),
        router => "router" if blocks || m.router.is_some(), norm_eps => "norm-eps" if m.norm_eps.is_some(),
        qkv_bias => "qkv-bias" if blocks || m.qkv_bias.is_some(),
        dense_first => "dense-first" if m.dense_first.is_some(), dense_d_ff => "dense-d-ff" if m.dense_d_ff.is_some(),
        latent_attention => "kv-lora-rank" if m.kv_lora_rank.is_some() || m.q_lora_rank.is_some() || m.rope_head_dim.is_some(),
        shared_expert_gate => "shared-expert-gate" if blocks || m.shared_expert_gate.is_some());
    // The attention's shape as the model has it (a width left out is the default one).
    let shape = [
        ("kv-heads", m.kv_heads.is_some() || ours.n_kv_heads.is_some(), ours.kv_heads(), theirs.kv_heads()),
        ("head-dim", m.head_dim.is_some() || ours.head_dim.is_some(), ours.head_width(), theirs.head_width()),
    ];
    let clash = clash.or_else(|| {
        shape
            .into_iter()
            .find(|&(_, said, a, b)| said && a != b)
            .map(|(flag, _, a, b)| format!("--{flag} {a} (the model in {} has {b})", dir.display()))
    });
    if let Some(clash) = clash {
        bail!("--init-from: the model is the directory's, but {clash}");
    }
    // The training options are the run's: how it balances, its capacity — except that a model
    // that routes by its bias (DeepSeek-V3's) keeps balancing by it unless told otherwise.
    let balance_said = m.balance.is_some() || c.model.balance != default.balance;
    c.model = lazarus_model::ModelConfig {
        aux_loss_coef: c.model.aux_loss_coef,
        capacity_factor: c.model.capacity_factor,
        balance: if balance_said { c.model.balance } else { theirs.balance },
        bias_update_rate: c.model.bias_update_rate,
        ..theirs
    };
    if args.model.seq_len.is_none() {
        c.seq_len = c.seq_len.min(c.model.max_seq_len);
    }
    adopt_model_tokenizer(c, &dir)
}

/// The tokenizer of the model in `dir` (its `tokenizer.json`) for text data when no other was
/// given: the model's token ids are that tokenizer's, and reading its text as bytes would train
/// it on other ids without a word. Without one, text data is refused unless the model's
/// vocabulary is the bytes' own.
pub(super) fn adopt_model_tokenizer(c: &mut TrainConfig, dir: &Path) -> Result<()> {
    if c.tokenizer.is_some() || c.data.is_tokens() {
        return Ok(());
    }
    let theirs = dir.join("tokenizer.json");
    if theirs.is_file() {
        tracing::info!("--init-from: the text is tokenized by the model's own {}", theirs.display());
        c.tokenizer = Some(theirs);
        return Ok(());
    }
    let bytes = lazarus_model::data::ByteTokenizer::VOCAB;
    if c.model.vocab_size != bytes {
        bail!(
            "--init-from: the model in {} has a vocabulary of {} tokens but no tokenizer.json beside it, and {} is text: \
             give --tokenizer FILE (the tokenizer the model was trained with), or token shards (--data-format u16|u32)",
            dir.display(),
            c.model.vocab_size,
            c.data.describe()
        );
    }
    Ok(())
}

/// The `[model]` table's `arch` key, taken out of it, with the keys the table sets itself (they
/// override the preset's).
pub(super) fn take_arch(table: &mut toml::Table) -> Result<Option<(lazarus_model::config::Arch, Vec<String>)>> {
    let Some(toml::Value::Table(model)) = table.get_mut("model") else { return Ok(None) };
    let Some(arch) = model.remove("arch") else { return Ok(None) };
    let arch = match arch {
        toml::Value::String(a) => choice("arch", &a, "gpt, mixtral, qwen-moe, qwen2-moe or deepseek-moe")
            .map_err(|_| anyhow::anyhow!("model.arch = '{a}' (expected gpt, mixtral, qwen-moe or deepseek-moe)"))?,
        other => bail!("model.arch = {other} (expected \"gpt\", \"mixtral\", \"qwen-moe\" or \"deepseek-moe\")"),
    };
    Ok(Some((arch, model.keys().cloned().collect())))
}

/// `model` with the options of `arch` wherever the file did not set them itself.
pub(super) fn with_arch_under(
    model: lazarus_model::ModelConfig,
    arch: lazarus_model::config::Arch,
    said: &[String],
) -> lazarus_model::ModelConfig {
    let preset = model.clone().with_arch(arch);
    let mut m = model;
    macro_rules! unless_said {
        ($($field:ident),*) => {
            $(if !said.iter().any(|k| k == stringify!($field)) { m.$field = preset.$field.clone(); })*
        };
    }
    unless_said!(
        norm,
        positions,
        rope_theta,
        expert_act,
        attn_bias,
        qkv_bias,
        ffn_bias,
        normalize_top_k,
        shared_experts,
        shared_expert_gate,
        moe_every,
        qk_norm,
        router
    );
    m
}

/// With a tokenizer the model's vocabulary is the tokenizer's, unless `--vocab-size` asks for
/// more (never fewer: its tokens would fall outside).
pub(super) fn size_vocabulary(args: &TrainArgs, c: &mut TrainConfig) -> Result<()> {
    let Some(path) = &c.tokenizer else { return Ok(()) };
    let have = lazarus_model::tokenizer::TextTokenizer::open(Some(path)).context("--tokenizer")?.vocab_size();
    if let Some(dir) = &c.init_from {
        // The vocabulary is the model's: the tokenizer must fit in it.
        if have > c.model.vocab_size {
            bail!(
                "--tokenizer {} has {have} tokens, more than the vocabulary of the model in {} ({})",
                path.display(),
                dir.display(),
                c.model.vocab_size
            );
        }
        return Ok(());
    }
    match args.model.vocab_size {
        None => c.model.vocab_size = have,
        Some(v) if v < have => bail!("invalid --vocab-size: {v} (the tokenizer {} has {have} tokens)", path.display()),
        Some(_) => {}
    }
    Ok(())
}

/// A choice flag's value as the option's type (its TOML spelling), or an error naming the flag,
/// the value and the choices.
pub(super) fn choice<T: serde::de::DeserializeOwned>(flag: &str, value: &str, choices: &str) -> Result<T> {
    toml::Value::String(value.to_string()).try_into().map_err(|_| anyhow::anyhow!("invalid --{flag}: '{value}' (expected {choices})"))
}

/// The block options flags set, on top of `m`: `--arch` first, then each option's own flag.
pub(super) fn apply_block_flags(args: &ModelArgs, m: &mut lazarus_model::ModelConfig) -> Result<()> {
    if let Some(a) = &args.arch {
        let arch: lazarus_model::config::Arch = choice("arch", a, "gpt, mixtral, qwen-moe, qwen2-moe or deepseek-moe")?;
        *m = m.clone().with_arch(arch);
    }
    if let Some(v) = &args.norm {
        m.norm = choice("norm", v, "layer or rms")?;
    }
    if let Some(v) = &args.positions {
        m.positions = choice("positions", v, "learned or rope")?;
    }
    if let Some(v) = &args.expert_act {
        m.expert_act = choice("expert-act", v, "gelu or swiglu")?;
    }
    if let Some(v) = &args.router {
        m.router = choice("router", v, "softmax or sigmoid")?;
    }
    macro_rules! set {
        ($($flag:ident),*) => {
            $(if let Some(v) = args.$flag { m.$flag = v; })*
        };
    }
    set!(
        rope_theta,
        normalize_top_k,
        shared_experts,
        shared_expert_gate,
        attn_bias,
        qkv_bias,
        ffn_bias,
        qk_norm,
        routed_scaling,
        expert_groups,
        top_groups,
        norm_eps
    );
    if let Some(v) = args.kv_heads {
        m.n_kv_heads = Some(v);
    }
    if let Some(v) = args.head_dim {
        m.head_dim = Some(v);
    }
    if let Some(v) = args.dense_first {
        m.dense_first = v;
    }
    if let Some(v) = args.dense_d_ff {
        m.dense_d_ff = Some(v);
    }
    if args.kv_lora_rank.is_some() || args.q_lora_rank.is_some() || args.rope_head_dim.is_some() {
        let was = m.latent_attention;
        let Some(kv_rank) = args.kv_lora_rank.or(was.map(|l| l.kv_rank)) else {
            bail!("--q-lora-rank and --rope-head-dim shape latent attention: turn it on with --kv-lora-rank N");
        };
        m.latent_attention = Some(lazarus_model::config::LatentAttention {
            kv_rank,
            q_rank: args.q_lora_rank.or(was.and_then(|l| l.q_rank)),
            rope_dim: args.rope_head_dim.or(was.map(|l| l.rope_dim)).unwrap_or(m.head_width() / 2),
        });
    }
    Ok(())
}

/// The settings flags on top of `c` (defaults or a `--config` file, or a resumed run's).
pub(super) fn apply_flags(args: &TrainArgs, c: &mut TrainConfig) -> Result<()> {
    apply_block_flags(&args.model, &mut c.model)?;
    macro_rules! set {
        ($($($flag:ident).+ => $($field:ident).+),* $(,)?) => {
            $(if let Some(v) = args.$($flag).+.clone() { c.$($field).+ = v; })*
        };
    }
    set!(steps => steps, model.batch_size => batch_size, model.seq_len => seq_len, model.lr => lr, model.min_lr => min_lr,
         model.warmup_steps => warmup_steps, model.vocab_size => model.vocab_size, model.d_model => model.d_model, model.layers => model.n_layers,
         model.heads => model.n_heads, model.experts => model.n_experts, model.top_k => model.top_k, model.d_ff => model.d_ff,
         model.moe_every => model.moe_every, model.aux_loss_coef => model.aux_loss_coef, model.seed => seed,
         model.bias_update_rate => model.bias_update_rate,
         checkpoint_every => checkpoint_every, keep_checkpoints => keep_checkpoints);
    if let Some(v) = &args.model.grad_clip {
        c.grad_clip = off_or("grad-clip", v)?;
    }
    if let Some(v) = &args.model.capacity_factor {
        c.model.capacity_factor = off_or("capacity-factor", v)?;
    }
    if let Some(v) = &args.model.balance {
        c.model.balance = choice("balance", v, "aux, bias or both")?;
    }
    if let Some(p) = &args.model.routing_trace {
        c.routing_trace = Some(p.clone());
    }
    if let Some(p) = &args.model.tokenizer {
        c.tokenizer = Some(p.clone());
    }
    if let Some(d) = &args.model.dtype {
        c.dtype = lazarus_model::Precision::parse(d)?;
    }
    if let Some(p) = &args.checkpoint_dir {
        c.checkpoint_dir = Some(p.clone());
    }
    if let Some(seq) = args.model.seq_len {
        c.model.max_seq_len = c.model.max_seq_len.max(seq);
    }
    match (args.model.data.as_deref(), args.model.data_format.as_deref()) {
        (None, Some(f)) => bail!("--data-format {f} needs --data FILE"),
        (None | Some("synthetic"), fmt) => {
            if fmt.is_some_and(|f| f != "text") {
                bail!("invalid --data-format: {} (the synthetic corpus is text)", fmt.unwrap_or_default());
            }
            if args.model.data.is_some() && !matches!(c.data, DataSource::Synthetic { .. }) {
                c.data = TrainConfig::default().data;
            }
            if let Some(bytes) = args.model.synthetic_bytes {
                let DataSource::Synthetic { seed, .. } = c.data else {
                    bail!(
                        "--synthetic-bytes sizes the synthetic corpus, but the data is {} (from --config); drop one of them",
                        c.data.describe()
                    );
                };
                c.data = DataSource::Synthetic { seed, bytes };
            }
        }
        (Some(path), fmt) => c.data = data_file("data", path, fmt, args.model.data_column.as_deref())?,
    }
    match (&mut c.data, &args.model.data_column, &args.model.data_cache) {
        (DataSource::Parquet(t) | DataSource::Arrow(t), col, dir) => {
            t.column = col.clone().or(t.column.take());
            t.cache = dir.clone().or(t.cache.take());
        }
        (_, Some(_), _) => bail!("--data-column names a column of Parquet or Arrow files, but the data is {}", c.data.describe()),
        (_, _, Some(_)) => bail!("--data-cache keeps Parquet and Arrow files' token caches, but the data is {}", c.data.describe()),
        _ => {}
    }
    if let Some(w) = &args.model.data_weights {
        let (DataSource::Megatron { prefixes, weights }
        | DataSource::Parquet(TableFiles { paths: prefixes, weights, .. })
        | DataSource::Arrow(TableFiles { paths: prefixes, weights, .. })) = &mut c.data
        else {
            bail!(
                "--data-weights blends Megatron datasets, Parquet or Arrow files, but the data is {}: give --data-format megatron, parquet or arrow",
                c.data.describe()
            );
        };
        let parsed = w
            .split(',')
            .map(|x| x.trim().parse::<f64>().ok().filter(|v| v.is_finite() && *v > 0.0))
            .collect::<Option<Vec<f64>>>()
            .with_context(|| format!("invalid --data-weights: '{w}' (positive numbers, comma-separated)"))?;
        if parsed.len() != prefixes.len() {
            bail!("invalid --data-weights: '{w}' ({} weights for {} datasets: one a dataset)", parsed.len(), prefixes.len());
        }
        *weights = Some(parsed);
    }
    if args.model.synthetic_bytes.is_some() && args.model.data.as_deref().is_some_and(|d| d != "synthetic") {
        bail!(
            "--synthetic-bytes sizes the synthetic corpus; --data {} reads a file instead: drop one of them",
            args.model.data.as_deref().unwrap_or_default()
        );
    }
    Ok(())
}

/// The format of `--eval-data`: `--eval-data-format`, else the file's own extension (`.jsonl`,
/// `.txt`), else the training data's `--data-format` — held-out text beside JSON-lines training
/// data is the common case, and forcing it into the training data's format failed.
pub fn eval_data_format(args: &TrainArgs) -> Option<&str> {
    if let Some(f) = args.eval_data_format.as_deref() {
        return Some(f);
    }
    let path = args.eval_data.as_deref()?;
    match Path::new(path).extension().and_then(|e| e.to_str()) {
        Some("jsonl") => Some("jsonl"),
        Some("txt") => Some("text"),
        Some("parquet") => Some("parquet"),
        Some("arrow") => Some("arrow"),
        _ => args.model.data_format.as_deref(),
    }
}

/// The data `--{flag} PATH` names (a text file, comma-separated token shards, comma-separated
/// Megatron dataset prefixes, or comma-separated Parquet or Arrow files) in `format`
/// (`--data-format`: text, jsonl, u16, u32, megatron, parquet or arrow; default parquet or arrow
/// where every file ends in `.parquet` or every one in `.arrow`, else text); `column`, a Parquet
/// or Arrow source's column.
pub fn data_file(flag: &str, path: &str, format: Option<&str>, column: Option<&str>) -> Result<DataSource> {
    let paths: Vec<PathBuf> = path.split(',').map(PathBuf::from).collect();
    if let Some(i) = paths.iter().position(|p| p.as_os_str().is_empty()) {
        bail!("invalid --{flag}: '{path}' (file {} of {} has an empty name)", i + 1, paths.len());
    }
    // Parquet or Arrow when every file's name says so.
    let names: Vec<Option<TableFormat>> = paths.iter().map(|p| TableFormat::of_name(p)).collect();
    let named = names.iter().copied().reduce(|a, b| a.filter(|&a| Some(a) == b)).flatten();
    if format.is_none() && named.is_none() && names.iter().all(Option::is_some) {
        bail!("invalid --{flag}: '{path}' mixes Parquet and Arrow files (one format a source; blend them with --data-weights only within one)");
    }
    let format = format.unwrap_or(named.map_or("text", TableFormat::name));
    if column.is_some() && !matches!(format, "parquet" | "arrow") {
        bail!("--data-column names a column of Parquet or Arrow files, but --{flag} is read as {format}");
    }
    if let Some(c) = column.filter(|c| c.is_empty()) {
        bail!("invalid --data-column: '{c}' (a column's name)");
    }
    Ok(match format {
        "text" if paths.len() == 1 => DataSource::Text { path: paths[0].clone() },
        "text" => bail!("invalid --{flag}: '{path}' (a text source is one file)"),
        "jsonl" if paths.len() == 1 => DataSource::JsonLines { path: paths[0].clone() },
        "jsonl" => bail!("invalid --{flag}: '{path}' (a JSON-lines source is one file)"),
        "u16" => DataSource::Shards { paths, width: TokenWidth::U16 },
        "u32" => DataSource::Shards { paths, width: TokenWidth::U32 },
        "megatron" => DataSource::Megatron { prefixes: paths, weights: None },
        "parquet" => DataSource::Parquet(TableFiles { column: column.map(str::to_string), ..TableFiles::of(paths) }),
        "arrow" => DataSource::Arrow(TableFiles { column: column.map(str::to_string), ..TableFiles::of(paths) }),
        other => bail!("invalid --{flag}-format: '{other}' (expected text, jsonl, u16, u32, megatron, parquet or arrow)"),
    })
}
