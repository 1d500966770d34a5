//! `--resume-job`: a job a lost controller saved, taken back with its own settings.

use anyhow::{bail, Context, Result};
use std::time::Duration;

use lazarus_controller::control_loop::saved_job::SavedJob;
use lazarus_controller::control_loop::ResumeJob;
use lazarus_controller::JobPlan;
use lazarus_plan::ModelPlan;

use super::super::args::TrainArgs;
use super::recovery;

/// The running job a lost controller saved in `cfg`'s checkpoint directory, for this one to take
/// back: its plan, and how far its `--json-log` got (a record cut in half by the kill is dropped:
/// the agents send it again).
pub(super) fn saved_job_to_take_back(args: &TrainArgs, cfg: &lazarus_model::TrainConfig, g: usize) -> Result<(JobPlan, ResumeJob)> {
    let Some(dir) = &cfg.checkpoint_dir else { bail!("--resume-job needs --checkpoint-dir: the lost controller saved the job there") };
    let mut saved = SavedJob::read(&SavedJob::path_in(dir))?;
    if saved.gpus_per_node != g {
        bail!("invalid --gpus-per-node: {g} (the saved job {} has nodes of {})", saved.job_id, saved.gpus_per_node);
    }
    let placement = ModelPlan::from_json(&saved.state.plan).context("--resume-job: the saved plan")?;
    let last_logged = match &args.json_log {
        Some(path) => super::super::report::last_logged_step(path)?,
        None => None,
    };
    // The state is saved at each move; checkpoints written since are on disk. A rollback, if it
    // comes to one, goes back to the newest of them whose step the log holds: one the log
    // lacks (the controller was lost before the step's record) is heard of again from the
    // agents, with that step — taking it from the disk would count the step as logged, and its
    // record, replayed, would be dropped.
    let on_disk = lazarus_model::checkpoint::latest_step(dir);
    saved.state.checkpoint = checkpoint_to_take_back(saved.state.checkpoint, on_disk, last_logged);
    let recovery = recovery(args)?.unwrap_or_default();
    // Agents try again every 2 s at most: a member not back after several tries (or leases) is lost.
    let rejoin_within = (recovery.lease * 5).max(Duration::from_secs(10));
    tracing::info!(
        "taking back job {} at epoch {} (saved {}): {} workers, last step logged {}; waiting up to {:.0} s for their agents",
        saved.job_id,
        saved.state.epoch - saved.state.first_epoch,
        lazarus_protocol::when::utc_text(saved.saved_unix_ms),
        saved.state.ranks.len(),
        last_logged.unwrap_or(saved.state.last_step),
        rejoin_within.as_secs_f64()
    );
    Ok((JobPlan { map: placement.replica_map(), placement: Some(placement) }, ResumeJob { saved, last_logged, rejoin_within }))
}

/// The settings of the job saved in `flagged`'s checkpoint directory, to take it back as it
/// ran: a flag (or `--config`) that would change one — `--lr`, `--steps`, the `--workers` it was
/// started with — is refused by name, as is another job's state (its settings differ). A state
/// file of an earlier version, without them, leaves the flags' settings in force.
pub(super) fn saved_job_settings(args: &TrainArgs, flagged: lazarus_model::TrainConfig) -> Result<lazarus_model::TrainConfig> {
    let Some(dir) = flagged.checkpoint_dir.clone() else {
        bail!("--resume-job needs --checkpoint-dir: the lost controller saved the job there")
    };
    let saved = SavedJob::read(&SavedJob::path_in(&dir))?;
    let how = format!("--resume-job takes job {} back", saved.job_id);
    if let (Some(w), Some(l)) = (args.workers, saved.launched_workers) {
        if w != l {
            bail!(
                "{how} with its own settings; --workers {w} would change the workers it was started with ({l}; it has {} now)",
                saved.state.ranks.len()
            );
        }
    }
    let Some(config) = saved.config else {
        tracing::warn!("--resume-job: job {} was saved without its settings (an earlier version): the flags' are used", saved.job_id);
        return Ok(flagged);
    };
    super::super::args::check_unchanged(args, &config, &how, "the job")?;
    if let Some(steps) = super::super::args::resume_steps(args)?.filter(|&s| s != config.steps) {
        bail!("{how} with its own settings; --steps {steps} would change steps (the job has {})", config.steps);
    }
    Ok(lazarus_model::TrainConfig { checkpoint_dir: Some(dir), ..config })
}

/// The checkpoint a job taken back rolls back to, if it comes to that: the saved one, or a newer
/// one on disk whose step the log holds (one it does not hold is heard of again from the agents).
fn checkpoint_to_take_back(saved: Option<u64>, on_disk: Option<u64>, last_logged: Option<u64>) -> Option<u64> {
    let newer = on_disk.filter(|&s| last_logged.is_some_and(|l| s <= l) && saved.is_none_or(|c| s > c));
    newer.or(saved)
}

#[cfg(test)]
mod take_back_tests {
    use super::checkpoint_to_take_back as pick;

    #[test]
    fn a_checkpoint_on_disk_is_taken_only_if_the_log_holds_its_step() {
        // Written after the state was saved, its step logged: taken.
        assert_eq!(pick(Some(10), Some(20), Some(24)), Some(20));
        assert_eq!(pick(None, Some(20), Some(20)), Some(20));
        // Its step not logged (the controller was lost first): the saved one stands.
        assert_eq!(pick(Some(10), Some(50), Some(49)), Some(10));
        assert_eq!(pick(None, Some(50), None), None);
        // Older than the saved one, or none on disk: the saved one.
        assert_eq!(pick(Some(30), Some(20), Some(40)), Some(30));
        assert_eq!(pick(Some(30), None, Some(40)), Some(30));
    }
}
