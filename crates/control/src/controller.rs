//! The controller's decisions (the `lazarus-controller` crate, a pure function of state, event
//! and time) over the workers' own record of a committed step: the types the controller
//! process's loop feeds and reads.

/// Lists of ids as people read them (`0, 2, 4–9`).
pub use lazarus_controller::words;
pub use lazarus_controller::{
    BadJobState, JobSpec, JobState, LayerCase, MemberState, Move, MoveCause, MoveCost, NodeId, OnLoss, RankTransfer, RebalanceCase,
    RebalanceDecision, RebalanceVerdict, RestoredExpert, SnapshotHeld, StepRecord, Weighed, Weighing,
};

use crate::protocol::CommittedStep;

pub type Controller = lazarus_controller::Controller<CommittedStep>;
pub type Event = lazarus_controller::Event<CommittedStep>;
pub type Command = lazarus_controller::Command<CommittedStep>;
pub type StopReport = lazarus_controller::StopReport<CommittedStep>;

impl StepRecord for CommittedStep {
    fn step(&self) -> u64 {
        self.report.step
    }

    fn is_sound(&self) -> bool {
        self.report.loss.is_finite() && self.seconds.is_finite() && self.seconds >= 0.0
    }
}
