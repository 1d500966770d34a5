//! End-to-end training behaviour of the single-process trainer.

use lazarus_model::{DataSource, ModelConfig, TrainConfig, Trainer};

fn small() -> TrainConfig {
    TrainConfig {
        model: ModelConfig { d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 32, n_experts: 4, d_ff: 128, ..ModelConfig::default() },
        steps: 10,
        batch_size: 4,
        seq_len: 32,
        warmup_steps: 2,
        data: DataSource::Synthetic { seed: 3, bytes: 50_000 },
        ..TrainConfig::default()
    }
}

/// A trainer of [`small`] after one step, its checkpoint saved in a fresh directory named for
/// `name`: (the directory, the trainer, the checkpoint).
fn saved_after_a_step(name: &str) -> (std::path::PathBuf, Trainer, std::path::PathBuf) {
    let dir = temp_dir(name);
    let mut t = Trainer::new(small()).unwrap();
    t.step().unwrap();
    let saved = t.save_checkpoint(&dir).unwrap();
    (dir, t, saved)
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("lazarus-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn checkpoint_then_resume_gives_the_identical_next_step() {
    let dir = temp_dir("resume");
    let mut a = Trainer::new(small()).unwrap();
    for _ in 0..3 {
        a.step().unwrap();
    }
    let saved = a.save_checkpoint(&dir).unwrap();
    assert!(saved.ends_with("step-00000003"));
    let next_a = a.step().unwrap();
    let after_a = a.step().unwrap();

    let mut b = Trainer::resume(&dir, None).unwrap();
    assert_eq!(b.step, 3);
    let next_b = b.step().unwrap();
    let after_b = b.step().unwrap();
    assert_eq!(next_a.loss.to_bits(), next_b.loss.to_bits(), "{} vs {}", next_a.loss, next_b.loss);
    assert_eq!(after_a.loss.to_bits(), after_b.loss.to_bits());
    assert_eq!(next_a.expert_load, next_b.expert_load);
    for ((name, va), (_, vb)) in a.model.params().iter().zip(b.model.params().iter()) {
        let diff = (va.as_tensor() - vb.as_tensor()).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{name}");
    }
    assert_eq!(a.sampler.cursor(), b.sampler.cursor());
    // The files are safetensors + a manifest, and `latest` names the checkpoint.
    assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap(), "step-00000003");
    for f in ["model.safetensors", "optimizer.safetensors", "manifest.json"] {
        assert!(saved.join(f).is_file(), "{f}");
    }
}

/// Loss-free balancing (`balance = bias`): the routing bias moves with the loads of the steps
/// that trained (toward the mean: the busiest expert's goes down), the auxiliary loss is left
/// out of the loss, and a checkpoint keeps the bias, so the resumed run routes as the first one.
#[test]
fn the_routing_bias_follows_the_loads_and_a_resume_keeps_it() {
    use lazarus_model::config::Balance;
    let config = |balance| {
        let mut c = small();
        c.model.balance = balance;
        c.model.bias_update_rate = 0.01;
        c
    };
    let dir = temp_dir("route-bias");
    let mut a = Trainer::new(config(Balance::Bias)).unwrap();
    let bias = |t: &Trainer, l: usize| -> Vec<f32> { t.model.route_bias(l).unwrap().unwrap().as_tensor().to_vec1().unwrap() };
    assert_eq!(bias(&a, 0), vec![0.0; 4], "the choice starts as the router's own");
    let first = a.step().unwrap();
    for (l, load) in first.expert_load.iter().enumerate() {
        let mean = load.iter().sum::<u64>() as f64 / load.len() as f64;
        let expected: Vec<f32> = load
            .iter()
            .map(|&x| {
                if (x as f64) < mean {
                    0.01
                } else if (x as f64) > mean {
                    -0.01
                } else {
                    0.0
                }
            })
            .collect();
        assert_eq!(bias(&a, l), expected, "layer {l}: loads {load:?}");
    }
    // The loss differentiated is the language model's alone: an aux-trained model's first
    // step reports the same losses but moves the router otherwise.
    let mut aux = Trainer::new(config(Balance::Aux)).unwrap();
    let aux_first = aux.step().unwrap();
    assert_eq!((first.loss.to_bits(), first.aux_loss.to_bits()), (aux_first.loss.to_bits(), aux_first.aux_loss.to_bits()));
    let gate = |t: &Trainer| -> Vec<f32> { t.model.gate(0).unwrap().as_tensor().flatten_all().unwrap().to_vec1().unwrap() };
    assert_ne!(gate(&a), gate(&aux), "the auxiliary loss's gradient reached the router of the bias run");
    a.step().unwrap();
    a.save_checkpoint(&dir).unwrap();
    let next_a = a.step().unwrap();
    let mut b = Trainer::resume(&dir, None).unwrap();
    assert_eq!(b.config.model.balance, Balance::Bias);
    let next_b = b.step().unwrap();
    assert_eq!(next_a.expert_load, next_b.expert_load);
    assert_eq!(next_a.loss.to_bits(), next_b.loss.to_bits());
    assert_eq!(bias(&a, 1), bias(&b, 1));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_damaged_newest_checkpoint_gives_way_to_the_newest_intact_one() {
    let (dir, mut t, first) = saved_after_a_step("corrupt");
    t.step().unwrap();
    let second = t.save_checkpoint(&dir).unwrap();
    std::fs::write(second.join("model.safetensors"), b"garbage").unwrap();
    // Named itself, the damaged checkpoint is an error that names the file.
    let err = Trainer::resume(&second, None).err().expect("a damaged checkpoint must fail").to_string();
    assert!(err.contains("model.safetensors") && err.contains("damaged"), "{err}");
    // Through `latest`, the resume goes back to the newest intact one.
    let ok = Trainer::resume(&dir, None).unwrap();
    assert_eq!(ok.step, 1);
    assert_eq!(Trainer::resume(&first, None).unwrap().step, 1);
    // With every checkpoint damaged: an error that names each.
    std::fs::write(first.join("optimizer.safetensors"), b"junk").unwrap();
    let err = Trainer::resume(&dir, None).err().unwrap().to_string();
    assert!(err.contains("no intact checkpoint") && err.contains("step-00000001") && err.contains("step-00000002"), "{err}");
}

/// A run that starts over another's checkpoints sets them aside; when the new run's newest is
/// damaged its fallback never reaches back into the old run, and a resume from an older
/// checkpoint sets the newer ones aside before it could write over them.
#[test]
fn a_checkpoint_directory_never_mixes_two_runs() {
    use lazarus_model::checkpoint;
    let dir = temp_dir("runs");
    // The old run: steps 1 to 4.
    let mut old = Trainer::new(TrainConfig { run: Some("0ld".into()), keep_checkpoints: 0, ..small() }).unwrap();
    checkpoint::start_run(&dir, "0ld").unwrap();
    for _ in 0..4 {
        old.step().unwrap();
        old.save_checkpoint(&dir).unwrap();
    }
    // A new run over it: the old checkpoints are kept, aside.
    let aside = checkpoint::start_run(&dir, "new").unwrap().expect("the old run's checkpoints are set aside");
    assert!(aside.starts_with(dir.join("previous-runs")) && aside.join("step-00000004").join("manifest.json").is_file());
    assert_eq!(checkpoint::dir_run(&dir).as_deref(), Some("new"));
    let mut new = Trainer::new(TrainConfig { run: Some("new".into()), keep_checkpoints: 0, ..small() }).unwrap();
    for _ in 0..2 {
        new.step().unwrap();
        new.save_checkpoint(&dir).unwrap();
    }
    // An old-run checkpoint copied back in is no fallback for the new run.
    let stray = dir.join("step-00000001");
    std::fs::remove_dir_all(&stray).unwrap();
    std::fs::rename(aside.join("step-00000001"), &stray).unwrap();
    std::fs::write(dir.join("step-00000002").join("model.safetensors"), b"garbage").unwrap();
    let err = Trainer::resume(&dir, None).err().expect("no intact checkpoint of this run").to_string();
    assert!(err.contains("written by run 0ld, not this directory's run new"), "{err}");
    // A resume from step 1 of the run sets its steps 2 and 3 aside and points `latest` there.
    std::fs::remove_dir_all(&stray).unwrap();
    let mut again = Trainer::new(TrainConfig { run: Some("new".into()), keep_checkpoints: 0, ..small() }).unwrap();
    again.step().unwrap();
    again.save_checkpoint(&dir).unwrap();
    std::fs::remove_dir_all(dir.join("step-00000002")).unwrap();
    again.step().unwrap();
    again.step().unwrap();
    again.save_checkpoint(&dir).unwrap();
    std::fs::write(dir.join("latest"), "step-00000001").unwrap();
    let resumed = Trainer::resume(&dir, None).unwrap();
    assert_eq!((resumed.step, resumed.config.run.as_deref()), (1, Some("new")), "a resume keeps the run");
    let moved = checkpoint::set_aside_newer(&dir, resumed.step).unwrap();
    assert_eq!(moved.len(), 1);
    assert!(moved[0].ends_with("step-00000003") && moved[0].join("manifest.json").is_file());
    assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap(), "step-00000001");
    assert!(!dir.join("step-00000003").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A resume from one of a run's step directories goes on in the run's directory; one from a
/// checkpoint copied out on its own (no run beside it), or from the run's directory, in the
/// directory given.
#[test]
fn a_resume_writes_in_its_runs_directory() {
    use lazarus_model::checkpoint;
    let dir = temp_dir("run-dir");
    let mut t = Trainer::new(TrainConfig { run: Some("r".into()), keep_checkpoints: 0, ..small() }).unwrap();
    checkpoint::start_run(&dir, "r").unwrap();
    t.step().unwrap();
    let step1 = t.save_checkpoint(&dir).unwrap();
    let from_step = Trainer::resume(&step1, None).unwrap();
    assert_eq!(from_step.config.checkpoint_dir.as_deref(), Some(dir.as_path()));
    let from_run = Trainer::resume(&dir, None).unwrap();
    assert_eq!(from_run.config.checkpoint_dir.as_deref(), Some(dir.as_path()));
    let alone = temp_dir("run-dir-alone").join("step-00000001");
    std::fs::create_dir_all(alone.parent().unwrap()).unwrap();
    std::fs::rename(&step1, &alone).unwrap();
    let from_alone = Trainer::resume(&alone, None).unwrap();
    assert_eq!(from_alone.config.checkpoint_dir.as_deref(), Some(alone.as_path()));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(alone.parent().unwrap());
}

/// One flipped bit inside a tensor still parses as safetensors: only the checksum finds it.
#[test]
fn a_flipped_byte_inside_a_tensor_is_found_on_load() {
    let (_, _, saved) = saved_after_a_step("flip");
    let path = saved.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let err = Trainer::resume(&saved, None).err().expect("a flipped byte must be found").to_string();
    assert!(err.contains("model.safetensors is damaged") && err.contains("CRC-32"), "{err}");
}

#[test]
fn a_non_finite_weight_is_never_saved_and_stale_temporaries_are_cleaned() {
    let (dir, mut t, _) = saved_after_a_step("nan");
    // A write a killed process left behind (its pid cannot be alive: above pid_max).
    let stale = dir.join(".tmp-step-00000009-4999999");
    std::fs::create_dir_all(&stale).unwrap();
    let (name, var) = t.model.params().iter().next().map(|(n, v)| (n.to_string(), v.clone())).unwrap();
    let mut values: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
    values[0] = f32::NAN;
    var.set(&candle_core::Tensor::from_vec(values, var.shape(), var.device()).unwrap()).unwrap();
    t.step = 2;
    let err = t.save_checkpoint(&dir).expect_err("a NaN weight must not be saved").to_string();
    assert!(err.contains(&name) && err.contains("non-finite"), "{err}");
    assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap(), "step-00000001", "latest unchanged");
    assert!(!stale.exists(), "a dead writer's temporary directory is removed");
}

/// `--lr 1e30`: the first step that makes a loss or gradient non-finite is refused, not trained
/// through to the end.
#[test]
fn a_diverging_run_stops_with_an_error_instead_of_training_on_nans() {
    let mut c = small();
    c.lr = 1e30;
    c.warmup_steps = 0;
    let mut t = Trainer::new(c).unwrap();
    let err = (0..10).find_map(|_| t.step().err()).expect("divergence is an error").to_string();
    assert!(err.contains("diverged") && err.contains("not applied"), "{err}");
}

/// `--checkpoint-every 1` must not fill the disk: the newest `keep_checkpoints` stay.
#[test]
fn only_the_newest_checkpoints_are_kept() {
    let dir = temp_dir("keep");
    let mut t = Trainer::new(TrainConfig { keep_checkpoints: 2, ..small() }).unwrap();
    for _ in 0..5 {
        t.step().unwrap();
        t.save_checkpoint(&dir).unwrap();
    }
    let mut kept: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("step-"))
        .collect();
    kept.sort();
    assert_eq!(kept, vec!["step-00000004", "step-00000005"]);
    assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap(), "step-00000005");
    // 0 keeps every one.
    let dir = temp_dir("keep-all");
    let mut t = Trainer::new(TrainConfig { keep_checkpoints: 0, ..small() }).unwrap();
    for _ in 0..4 {
        t.step().unwrap();
        t.save_checkpoint(&dir).unwrap();
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with("step-")).count(), 4);
}

#[test]
fn bad_configuration_names_the_field() {
    let mut c = small();
    c.model.top_k = 9;
    assert!(Trainer::new(c).err().unwrap().to_string().contains("top_k"));
    let mut c = small();
    c.model.top_k = c.model.n_experts + 1;
    assert!(Trainer::new(c).err().unwrap().to_string().contains("top_k"));
    let mut c = small();
    c.model = c.model.mixtral();
    c.model.rope_theta = 0.5;
    assert!(Trainer::new(c).err().unwrap().to_string().contains("rope_theta"));
    let mut c = small();
    c.seq_len = 64;
    assert!(Trainer::new(c).err().unwrap().to_string().contains("seq_len"));
    let mut c = small();
    c.lr = f64::NAN;
    assert!(Trainer::new(c).err().unwrap().to_string().contains("lr"));
    let mut c = small();
    c.model.n_heads = 3;
    assert!(Trainer::new(c).err().unwrap().to_string().contains("n_heads"));
}

/// The default model learns: within 120 steps of 8 × 64 tokens its loss is more than a nat
/// below the unigram entropy of the synthetic corpus (what a model that only knows byte
/// frequencies would reach).
#[test]
fn default_model_learns_well_below_unigram_entropy() {
    let config = TrainConfig {
        steps: 120,
        batch_size: 8,
        seq_len: 64,
        lr: 3e-3,
        warmup_steps: 10,
        data: DataSource::Synthetic { seed: 0, bytes: 400_000 },
        ..TrainConfig::default()
    };
    let mut t = Trainer::new(config).unwrap();
    let entropy = t.unigram_entropy();
    let mut losses = Vec::new();
    while !t.done() {
        losses.push(t.step().unwrap().loss);
    }
    let last: f64 = losses[losses.len() - 10..].iter().sum::<f64>() / 10.0;
    eprintln!("unigram entropy {entropy:.3}, first loss {:.3}, mean of last 10 {last:.3}", losses[0]);
    assert!(losses[0] > entropy, "an untrained model should be worse than unigram");
    assert!(last < entropy - 1.0, "loss {last:.3} not well below unigram entropy {entropy:.3}");
}

/// The same run on a GPU and on the CPU: the same losses (f32, different summation orders:
/// within 1e-3 relative over 10 steps), and a checkpoint written on the GPU resumes on the CPU
/// to the same next step. Skipped, with the reason, where no GPU can be opened.
#[test]
fn a_run_on_a_gpu_follows_the_cpu_run_and_its_checkpoint_resumes_anywhere() {
    let Some(gpu) = the_gpu() else { return };
    let config = TrainConfig { steps: 12, ..small() };
    let mut cpu_run = Trainer::new(config.clone()).unwrap();
    let mut gpu_run = Trainer::new_on(config, &gpu).unwrap();
    for _ in 0..10 {
        let (a, b) = (cpu_run.step().unwrap(), gpu_run.step().unwrap());
        assert!((a.loss - b.loss).abs() <= 1e-3 * a.loss, "step {}: cpu {} gpu {}", a.step, a.loss, b.loss);
        assert_eq!(a.expert_load.len(), b.expert_load.len());
    }
    resumes_on_the_cpu_to_the_same_step(&mut gpu_run, "gpu-resume");
}

/// bf16 mixed precision: refused on the CPU with the reason; on a GPU, 10 steps follow the f32
/// run within 2%, the checkpoint holds f32 tensors and resumes the bf16 run to the same next
/// step.
#[test]
fn bf16_mixed_precision_follows_f32_on_a_gpu_and_is_refused_on_the_cpu() {
    let bf16 = TrainConfig { steps: 12, dtype: lazarus_model::Precision::Bf16, ..small() };
    let err = Trainer::new(bf16.clone()).err().expect("bf16 on the CPU").to_string();
    assert!(err.contains("dtype") && err.contains("GPU"), "{err}");
    let Some(gpu) = the_gpu() else { return };
    let mut full = Trainer::new_on(TrainConfig { steps: 12, ..small() }, &gpu).unwrap();
    let mut mixed = Trainer::new_on(bf16, &gpu).unwrap();
    for _ in 0..10 {
        let (a, b) = (full.step().unwrap(), mixed.step().unwrap());
        assert!((a.loss - b.loss).abs() <= 0.02 * a.loss, "step {}: f32 {} bf16 {}", a.step, a.loss, b.loss);
    }
    let dir = temp_dir("bf16");
    mixed.save_checkpoint(&dir).unwrap();
    let mut resumed = Trainer::resume_on(&dir, None, &gpu).unwrap();
    assert_eq!(resumed.config.dtype, lazarus_model::Precision::Bf16);
    assert_eq!(resumed.model.params().vars()[0].dtype(), candle_core::DType::F32);
    // The resumed run's working copies are made from the loaded parameters: its next step is the
    // uninterrupted run's.
    let (a, b) = (mixed.step().unwrap(), resumed.step().unwrap());
    assert!((a.loss - b.loss).abs() <= 1e-5 * a.loss, "bf16 {} vs resumed {}", a.loss, b.loss);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Mixtral's blocks (RMSNorm, rotary positions, SwiGLU experts without biases, top-2) with a
/// shared expert and a dense block, on the GPU layers: 10 steps follow the CPU run (f32, 1e-3
/// relative), bf16 follows the f32 GPU run within 2%, and the GPU checkpoint resumes on the CPU
/// to the same next step.
#[test]
fn a_mixtral_run_on_a_gpu_follows_the_cpu_run_in_f32_and_bf16() {
    let Some(gpu) = the_gpu() else { return };
    let base = small();
    let model = ModelConfig { shared_experts: 1, moe_every: 2, n_heads: 4, ..base.model.clone().mixtral() };
    let config = TrainConfig { steps: 12, model, ..base };
    let mut cpu_run = Trainer::new(config.clone()).unwrap();
    let mut gpu_run = Trainer::new_on(config.clone(), &gpu).unwrap();
    assert!(gpu_run.model.gpu_kernels(), "the Mixtral blocks run on the GPU layers");
    let mut mixed = Trainer::new_on(TrainConfig { dtype: lazarus_model::Precision::Bf16, ..config }, &gpu).unwrap();
    for _ in 0..10 {
        let (a, b, c) = (cpu_run.step().unwrap(), gpu_run.step().unwrap(), mixed.step().unwrap());
        assert!((a.loss - b.loss).abs() <= 1e-3 * a.loss, "step {}: cpu {} gpu {}", a.step, a.loss, b.loss);
        assert!((b.loss - c.loss).abs() <= 0.02 * b.loss, "step {}: f32 {} bf16 {}", b.step, b.loss, c.loss);
    }
    resumes_on_the_cpu_to_the_same_step(&mut gpu_run, "gpu-mixtral");
}

/// The loads a plan is made from are measured a few sequences at a time (a thousand nodes'
/// batch in one forward held gigabytes): the same counts as one forward of the whole batch,
/// and the data cursor does not move.
#[test]
fn loads_measured_in_pieces_are_those_of_one_forward_of_the_batch() {
    let cfg = TrainConfig { batch_size: 300, seq_len: 4, ..small() };
    let mut t = Trainer::new(cfg.clone()).unwrap();
    let loads = t.measure_loads(1).unwrap();
    let batch = t.sampler.peek_batch(300).unwrap();
    let device = t.model.device().clone();
    let x = candle_core::Tensor::from_vec(batch.inputs.clone(), (300, 4), &device).unwrap();
    let y = candle_core::Tensor::from_vec(batch.targets.clone(), (300, 4), &device).unwrap();
    let whole = t.model.forward(&x, &y, None).unwrap();
    let expected: Vec<Vec<f64>> = whole.moe.iter().map(|s| s.load.iter().map(|&c| c as f64).collect()).collect();
    assert_eq!(loads, expected);
    let routed: f64 = loads[0].iter().sum();
    assert_eq!(routed, (300 * 4 * cfg.model.top_k) as f64);
    // The cursor did not move: the first step is a fresh trainer's.
    let mut fresh = Trainer::new(cfg).unwrap();
    assert_eq!(t.step().unwrap().loss.to_bits(), fresh.step().unwrap().loss.to_bits());
}

/// The test machine's GPU (None, said on stderr: the GPU tests are skipped).
fn the_gpu() -> Option<candle_core::Device> {
    lazarus_model::device::parse("cuda:0").map_err(|e| eprintln!("skipped (no GPU): {e}")).ok()
}

/// `run`'s checkpoint (written to a directory named for `what`) resumed on the CPU takes the
/// same next step as `run` itself, to 1e-4.
fn resumes_on_the_cpu_to_the_same_step(run: &mut Trainer, what: &str) {
    let dir = temp_dir(what);
    run.save_checkpoint(&dir).unwrap();
    let mut resumed = Trainer::resume(&dir, None).unwrap();
    let (a, b) = (run.step().unwrap(), resumed.step().unwrap());
    assert!((a.loss - b.loss).abs() <= 1e-4 * a.loss, "gpu {} vs resumed on cpu {}", a.loss, b.loss);
    let _ = std::fs::remove_dir_all(&dir);
}
