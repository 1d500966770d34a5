//! `lazarus` — resilient Mixture-of-Experts training. See the README for the commands.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod planning;
mod training;

#[derive(Parser)]
#[command(name = "lazarus", version, about = "Resilient and elastic training of Mixture-of-Experts models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Allocate expert replicas, place them on the cluster and show how likely it survives failures.
    Plan(planning::PlanArgs),
    /// Probability that a plan recovers with a given number of failed nodes.
    Prob(planning::ProbArgs),
    /// Train the MoE model (single process; with no arguments, the default model on the
    /// built-in synthetic corpus).
    Train(Box<training::TrainArgs>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(args) => planning::run_plan(&args),
        Command::Prob(args) => planning::run_prob(&args),
        Command::Train(args) => training::run_train(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
