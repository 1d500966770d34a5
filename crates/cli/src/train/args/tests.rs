use proptest::prelude::*;

use super::*;

/// `lazarus train`'s flags alone, as a command.
#[derive(clap::Parser)]
struct TrainCli {
    #[command(flatten)]
    train: TrainArgs,
}

/// The flags of `lazarus train EXTRA…`.
fn train_args(extra: &[&str]) -> TrainArgs {
    use clap::Parser;
    let mut argv = vec!["train"];
    argv.extend_from_slice(extra);
    TrainCli::try_parse_from(argv).unwrap().train
}

const CONFIG: &str = "steps = 500\nlr = 0.002\nbatch_size = 8\n[model]\nn_experts = 8\ntop_k = 2\ncapacity_factor = 1.25\n[data]\nkind = \"synthetic\"\nseed = 3\nbytes = 100000\n";

/// `--arch mixtral` and `arch = "mixtral"` set Mixtral's options; the file's own keys and
/// the single flags win over the preset; bad values name the flag or key.
#[test]
fn the_arch_preset_and_the_block_options_come_from_flags_and_the_file() {
    use lazarus_model::config::{Activation, NormKind, Positions};
    let parse = |extra: &[&str]| build_config(&train_args(extra));
    let m = parse(&["--arch", "mixtral"]).unwrap().model;
    assert_eq!(
        (m.norm, m.positions, m.expert_act, m.attn_bias, m.ffn_bias),
        (NormKind::Rms, Positions::Rope, Activation::Swiglu, false, false)
    );
    assert_eq!(m.rope_theta, 1e6);
    let m = parse(&[
        "--arch",
        "mixtral",
        "--norm",
        "layer",
        "--shared-experts",
        "2",
        "--normalize-top-k",
        "false",
        "--top-k",
        "8",
        "--experts",
        "64",
    ])
    .unwrap()
    .model;
    assert_eq!((m.norm, m.shared_experts, m.normalize_top_k, m.top_k, m.expert_act), (NormKind::Layer, 2, false, 8, Activation::Swiglu));
    let m = parse(&["--positions", "rope", "--rope-theta", "500", "--ffn-bias", "false"]).unwrap().model;
    assert_eq!((m.positions, m.rope_theta, m.ffn_bias, m.norm), (Positions::Rope, 500.0, false, NormKind::Layer));
    for (flags, named) in [
        (&["--arch", "llama"][..], "--arch: 'llama'"),
        (&["--norm", "batch"], "--norm: 'batch'"),
        (&["--expert-act", "relu"], "--expert-act"),
        (&["--positions", "alibi"], "--positions"),
    ] {
        let e = format!("{:#}", parse(flags).unwrap_err());
        assert!(e.contains(named), "{e}");
    }
    assert!(format!("{:#}", parse(&["--top-k", "9"]).unwrap_err()).contains("top_k"));
    let m = parse(&["--arch", "qwen-moe", "--top-k", "8", "--experts", "64"]).unwrap().model;
    assert_eq!((m.qk_norm, m.norm, m.expert_act, m.attn_bias), (true, NormKind::Rms, Activation::Swiglu, false));
    assert!(!parse(&["--arch", "qwen-moe", "--qk-norm", "false"]).unwrap().model.qk_norm, "the flag overrides the preset");
    let m = parse(&["--arch", "deepseek-moe", "--experts", "16", "--expert-groups", "4", "--top-groups", "2", "--routed-scaling", "2.5"])
        .unwrap()
        .model;
    assert_eq!(
        (m.router, m.shared_experts, m.expert_groups, m.top_groups, m.routed_scaling),
        (lazarus_model::config::RouterScore::Sigmoid, 1, 4, 2, 2.5)
    );
    assert!(format!("{:#}", parse(&["--router", "relu"]).unwrap_err()).contains("--router: 'relu'"));
    assert!(format!("{:#}", parse(&["--expert-groups", "3"]).unwrap_err()).contains("expert_groups"));
    let m = parse(&["--balance", "bias", "--bias-update-rate", "0.01"]).unwrap().model;
    assert_eq!((m.balance, m.bias_update_rate), (lazarus_model::config::Balance::Bias, 0.01));
    assert_eq!(parse(&[]).unwrap().model.balance, lazarus_model::config::Balance::Aux, "the auxiliary loss unless asked");
    assert!(format!("{:#}", parse(&["--balance", "loss-free"]).unwrap_err()).contains("--balance: 'loss-free'"));
    assert!(format!("{:#}", parse(&["--bias-update-rate", "-1"]).unwrap_err()).contains("bias_update_rate"));
    let dir = std::env::temp_dir().join(format!("lazarus-arch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("arch.toml");
    std::fs::write(&file, "[model]\narch = \"mixtral\"\nffn_bias = true\nshared_experts = 1\n").unwrap();
    let f = file.to_str().unwrap();
    let m = parse(&["--config", f]).unwrap().model;
    assert_eq!((m.norm, m.ffn_bias, m.shared_experts, m.attn_bias), (NormKind::Rms, true, 1, false));
    let m = parse(&["--config", f, "--arch", "gpt"]).unwrap().model;
    assert_eq!((m.norm, m.ffn_bias, m.shared_experts), (NormKind::Layer, true, 0), "the flag overrides the file");
    std::fs::write(&file, "[model]\narch = \"llama\"\n").unwrap();
    let e = format!("{:#}", parse(&["--config", f]).unwrap_err());
    assert!(e.contains("model.arch = 'llama'"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Settings that would do nothing are refused by name — a rotary base for learned
/// positions (flag or file), a replay's scale or notices without a replay, an evaluation
/// format without evaluation data — and held-out data takes its own format from its name
/// before the training data's.
#[test]
fn settings_that_would_do_nothing_are_refused_and_held_out_data_has_its_own_format() {
    let args = train_args;
    let refused = |extra: &[&str], want: &str| {
        let a = args(extra);
        let e = a.check_combinations().and_then(|_| build_config(&a).map(|_| ())).unwrap_err();
        assert!(format!("{e:#}").contains(want), "{extra:?}: {e:#}");
    };
    refused(&["--rope-theta", "5000"], "--rope-theta 5000: the model's positions are learned");
    refused(&["--replay-scale", "2", "--workers", "2"], "--replay-scale needs --replay SOURCE");
    refused(&["--replay-notice", "--workers", "2"], "--replay-notice needs --replay SOURCE");
    refused(&["--eval-data-format", "text"], "--eval-data-format needs --eval-data FILE");
    assert_eq!(build_config(&args(&["--arch", "mixtral", "--rope-theta", "5000"])).unwrap().model.rope_theta, 5000.0);
    let dir = std::env::temp_dir().join(format!("lazarus-theta-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("theta.toml");
    std::fs::write(&file, "[model]\nrope_theta = 5000.0\n").unwrap();
    refused(&["--config", file.to_str().unwrap()], "rope_theta = 5000.0 in --config");
    std::fs::write(&file, "[model]\narch = \"mixtral\"\nrope_theta = 5000.0\n").unwrap();
    assert_eq!(build_config(&args(&["--config", file.to_str().unwrap()])).unwrap().model.rope_theta, 5000.0);
    std::fs::remove_dir_all(&dir).unwrap();
    for (extra, want) in [
        (&["--data", "a.jsonl", "--data-format", "jsonl", "--eval-data", "held.txt"][..], Some("text")),
        (&["--data", "a.txt", "--eval-data", "held.jsonl"], Some("jsonl")),
        (&["--data", "a.bin", "--data-format", "u16", "--eval-data", "held.bin"], Some("u16")),
        (&["--data", "a.jsonl", "--data-format", "jsonl", "--eval-data", "held.txt", "--eval-data-format", "jsonl"], Some("jsonl")),
        (&["--eval-data", "held"], None),
    ] {
        assert_eq!(eval_data_format(&args(extra)), want, "{extra:?}");
    }
    let e = data_file("eval-data", "held", Some("csv"), None).unwrap_err().to_string();
    assert!(e.contains("invalid --eval-data-format: 'csv'"), "{e}");
}

/// Parquet and Arrow files are found by their names (in any case), one format a source.
#[test]
fn a_dataset_s_format_is_found_from_its_files_names() {
    use lazarus_model::data::{TableFiles, TableFormat};
    let table = |path: &str| data_file("data", path, None, None).map(|s| s.table().map(|(f, t)| (f, t.paths.len())));
    assert_eq!(table("a.parquet,b.PARQUET").unwrap(), Some((TableFormat::Parquet, 2)));
    assert_eq!(table("cache-1f2e.arrow").unwrap(), Some((TableFormat::Arrow, 1)));
    assert_eq!(table("notes.txt").unwrap(), None);
    let e = table("a.parquet,b.arrow").unwrap_err().to_string();
    assert!(e.contains("mixes Parquet and Arrow files"), "{e}");
    let given = data_file("data", "shard.bin", Some("arrow"), Some("input_ids")).unwrap();
    assert_eq!(given, DataSource::Arrow(TableFiles { column: Some("input_ids".into()), ..TableFiles::of(vec!["shard.bin".into()]) }));
}

/// `--help` tells every setting's default: the training settings' from `TrainConfig`, the
/// others in their own words; a flag without one is one that names a file or turns
/// something on.
#[test]
fn every_training_flag_says_its_default() {
    use clap::CommandFactory;
    let cmd = with_defaults(TrainCli::command(), &training_defaults());
    // Flags whose absence is their default: a file or place not given, a thing not done.
    let none = [
        "config",
        "checkpoint_dir",
        "init_from",
        "json_log",
        "eval_data",
        "eval_data_format",
        "eval_every",
        "eval_windows",
        "workers",
        "replay",
        "replay_scale",
        "metrics_listen",
        "metrics_token_file",
        "routing_trace",
        "tokenizer",
        "placement_file",
        "arch",
        "status_listen",
        "profile_steps",
        "shard_sequences",
        "snapshot_ceiling",
    ];
    let mut missing = Vec::new();
    for a in cmd.get_arguments() {
        let takes_value = a.get_num_args().is_some_and(|n| n.takes_values()) && !matches!(a.get_action(), clap::ArgAction::SetTrue);
        if !takes_value || none.contains(&a.get_id().as_str()) || !a.get_default_values().is_empty() {
            continue;
        }
        let help = a.get_help().map(|h| h.to_string()).unwrap_or_default().to_lowercase();
        if !help.contains("default") {
            missing.push(a.get_id().to_string());
        }
    }
    assert!(missing.is_empty(), "flags whose help does not say their default: {missing:?}");
    let lr = cmd.get_arguments().find(|a| a.get_id() == "lr").unwrap().get_help().unwrap().to_string();
    assert!(lr.ends_with("[default: 0.002]"), "{lr}");
    let norm = cmd.get_arguments().find(|a| a.get_id() == "norm").unwrap().get_help().unwrap().to_string();
    assert!(norm.ends_with("[default: layer]"), "{norm}");
}

#[test]
fn the_sample_config_parses() {
    let c: TrainConfig = toml::from_str(CONFIG).unwrap();
    c.validate().unwrap();
    assert_eq!((c.steps, c.model.capacity_factor), (500, Some(1.25)));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// A damaged `--config` is an error or a valid configuration, never a panic; what
    /// validates has every size within the model's limits.
    #[test]
    fn damaged_configs_never_panic(edits in proptest::collection::vec((0usize..200, any::<u8>()), 1..6), cut in 0usize..200) {
        let mut text = CONFIG.as_bytes().to_vec();
        for (pos, byte) in edits {
            if pos < text.len() {
                text[pos] = byte;
            }
        }
        text.truncate(cut.max(1).min(text.len()));
        if let Ok(s) = std::str::from_utf8(&text) {
            if let Ok(c) = toml::from_str::<TrainConfig>(s) {
                if c.validate().is_ok() {
                    prop_assert!(c.model.parameter_count() < 1u128 << 64);
                }
            }
        }
    }

    /// The one size check: a run is refused exactly when its estimate (times the processes
    /// holding the model) exceeds the machine, the refusal naming the flags that lower it;
    /// and no size grows without the estimate growing with it.
    #[test]
    fn the_size_check_refuses_exactly_what_exceeds_the_machine(
        d_model in 1usize..6, d_ff in 1usize..6, experts in 1usize..10, layers in 1usize..8,
        batch in 0usize..8, seq in 0usize..6, copies in 1u128..65,
    ) {
        let mut c: TrainConfig = toml::from_str(CONFIG).unwrap();
        (c.model.d_model, c.model.d_ff) = (64 << d_model, 64 << d_ff);
        (c.model.n_experts, c.model.n_layers, c.model.n_heads) = (1 << experts, 1 << layers, 1);
        (c.batch_size, c.seq_len) = (1 << batch, 16 << seq);
        let need = c.memory_estimate().saturating_mul(copies);
        let have = lazarus_agent::launcher::memory_available().map(|(b, _)| b);
        match check_fits(&c, copies) {
            Ok(()) => prop_assert!(have.is_none_or(|h| need <= h as u128)),
            Err(e) => {
                prop_assert!(have.is_some_and(|h| need > h as u128));
                prop_assert!(e.to_string().contains("GiB") && e.to_string().contains("--d-model"), "{e}");
            }
        }
        let mut bigger = c.clone();
        bigger.model.d_ff *= 2;
        bigger.batch_size *= 2;
        prop_assert!(bigger.memory_estimate() >= c.memory_estimate());
    }
}
