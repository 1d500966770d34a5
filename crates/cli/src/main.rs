//! `lazarus` — resilient Mixture-of-Experts training. See the README for the commands.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc, not the system's: the planner's moves and weighings at cluster scale make millions
/// of short lists across threads, where glibc's allocator was a sixth of a simulated day's time
/// (`lazarus sim` at 1,024 GPUs: 7% less wall time, same decisions).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod agent;
mod config_flags;
mod controller_bench;
mod evaluate;
mod export;
mod generate;
mod io;
mod join_rule;
mod moe_bench;
mod planning;
mod report;
mod simulate;
mod status;
mod tls;
mod tokenizer;
mod train;

#[derive(Parser)]
#[command(name = "lazarus", version, about = "Resilient and elastic training of Mixture-of-Experts models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Forward+backward throughput of the model, expert-FFN share, GFLOP/s vs plain matmul.
    Train(Box<train::bench::BenchTrainArgs>),
    /// One MoE layer over worker processes with skewed routing: Lazarus vs static expert
    /// parallelism, tokens/s and wire bytes.
    MoeLayer(Box<moe_bench::MoeLayerBenchArgs>),
    /// Live recovery: kill a worker at random steps and phases, time kill -> next completed step.
    Recovery(Box<train::recovery_bench::RecoveryBenchArgs>),
    /// A controller at cluster scale (1,024 nodes of 8 by default), driven by synthetic node
    /// agents on loopback: its CPU, memory, and how fast a node loss and a join reach every agent.
    Controller(Box<controller_bench::ControllerBenchArgs>),
}

#[derive(Subcommand)]
enum Command {
    /// Allocate expert replicas, place them on the cluster and show how likely it survives failures.
    Plan(Box<planning::PlanArgs>),
    /// Probability that a plan recovers with a given number of failed nodes.
    Prob(Box<planning::ProbArgs>),
    /// Train the MoE model (one process, or `--workers N` local worker processes; with no
    /// arguments, the default model on the built-in synthetic corpus).
    Train(Box<train::TrainArgs>),
    /// The loss and perplexity of a checkpoint on held-out data (windows taken in order).
    Eval(Box<evaluate::EvalArgs>),
    /// Text sampled from a checkpoint's model, after a prompt (temperature, top-k, seed).
    Generate(Box<generate::GenerateArgs>),
    /// A checkpoint's model as a Hugging Face directory (Mixtral, Qwen3-MoE, Qwen2-MoE or DeepSeek-V3).
    Export(Box<export::ExportArgs>),
    /// One self-contained HTML page of a run from its directory: loss, tokens/s and expert-load
    /// plots, every move of the job with what it cost, its settings.
    Report(Box<report::ReportArgs>),
    /// Learn a byte-level BPE tokenizer (Hugging Face tokenizer.json) from text.
    Tokenizer(Box<tokenizer::TokenizerArgs>),
    /// Simulate a training job on a failure or spot trace: Lazarus vs DeepSpeed-MoE baselines.
    Sim(Box<simulate::SimArgs>),
    /// Benchmarks with machine-readable reports.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// What the controller of a running job knows: members, epoch, plan, recent events.
    Status(Box<status::StatusArgs>),
    /// The controller of a job run by node agents on several hosts: takes the train flags
    /// (with --workers N), waits for agents to bring N workers, then trains and recovers.
    Controller(Box<train::workers::ControllerArgs>),
    /// One node of a job: attaches to its controller, runs this node's workers (one per GPU).
    Agent(Box<agent::AgentArgs>),
    /// One rank of `train --workers N` (started by it; reads its spec on stdin).
    #[command(hide = true)]
    Worker,
    /// One rank of `bench moe-layer` (started by it; reads its spec on stdin).
    #[command(hide = true)]
    BenchWorker,
}

/// Training allocates and frees multi-megabyte tensors every step. glibc serves those with
/// mmap and hands them back at once, so every step pays the kernel to zero fresh pages again;
/// keeping them in the heap made the default training run ~25% faster here. The mmap threshold
/// cannot go above 32 MiB, and a large expert's activations pass that (4096 rows × 2048 × 4 B),
/// so mmap is turned off altogether: the heap then serves and reuses every size.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator thresholds; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

/// Commands that only print let a closed pipe end them quietly (`lazarus sim | head`), as Unix
/// tools do; Rust ignores SIGPIPE and `println!` would panic. Commands that talk to worker
/// processes or sockets keep ignoring it, so a dead peer is an error they report, not a kill.
fn quiet_on_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// A worker's exit code (0 done, 1 failed and said why, 3 its launcher went away).
fn worker_exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// Logs and progress lines go to stderr through `tracing`, as plain lines (no time, level or
/// target: the human output of the commands); `LAZARUS_LOG` filters them (e.g. `warn`, `debug`).
fn init_logging() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("LAZARUS_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .without_time()
        .with_level(false)
        .with_target(false)
        .try_init();
}

fn main() -> ExitCode {
    tune_allocator();
    init_logging();
    // Every library's messages name a setting as its flag.
    lazarus_setting::spell_settings_as(config_flags::flag);
    // The training flags' defaults shown in --help (they are options, read from one place).
    let command = train::args::show_defaults(<Cli as clap::CommandFactory>::command())
        // A `--config` table's flags come first; the command line's own override them.
        .mut_subcommand("controller", |c| c.args_override_self(true))
        .mut_subcommand("agent", |c| c.args_override_self(true));
    let argv = match config_flags::with_config_tables(&command, std::env::args_os().collect()) {
        Ok(argv) => argv,
        Err(err) => {
            eprintln!("error: {err:#}");
            return ExitCode::FAILURE;
        }
    };
    let matches = command.get_matches_from(argv);
    let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let printing_only = match &cli.command {
        Command::Plan(_)
        | Command::Prob(_)
        | Command::Sim(_)
        | Command::Eval(_)
        | Command::Generate(_)
        | Command::Export(_)
        | Command::Report(_)
        | Command::Bench(BenchCommand::Train(_)) => true,
        Command::Train(args) => !args.uses_workers(),
        _ => false,
    };
    if printing_only {
        quiet_on_closed_pipe();
    }
    let result = match cli.command {
        Command::Plan(args) => planning::run_plan(&args),
        Command::Prob(args) => planning::run_prob(&args),
        Command::Train(args) => train::run(&args),
        Command::Bench(BenchCommand::Train(args)) => train::bench::run_bench_train(&args),
        Command::Bench(BenchCommand::MoeLayer(args)) => moe_bench::run_moe_layer_bench(&args),
        Command::Bench(BenchCommand::Recovery(args)) => train::recovery_bench::run_recovery_bench_cli(&args),
        Command::Bench(BenchCommand::Controller(args)) => controller_bench::run_controller_bench(&args),
        Command::Sim(args) => simulate::run_sim(&args),
        Command::Eval(args) => evaluate::run_eval(&args),
        Command::Generate(args) => generate::run_generate(&args),
        Command::Export(args) => export::run_export(&args),
        Command::Report(args) => report::run_report(&args),
        Command::Tokenizer(args) => tokenizer::run_tokenizer(&args),
        Command::Status(args) => status::run_status(&args),
        Command::Controller(args) => train::workers::run_controller(&args),
        Command::Agent(args) => agent::run_agent_cli(&args),
        Command::Worker => return worker_exit(lazarus_worker::run_train_worker()),
        Command::BenchWorker => return worker_exit(lazarus_bench::moe_layer::run_rank()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
