//! The snapshot tier's decisions (MoEtion §4, PEC §3; docs/architecture.md, snapshots): which experts to
//! copy into another node's memory after a step ([`selection`]), and how many bytes a step may
//! send when no bandwidth is given ([`pace`]).
//!
//! Both are pure functions of inputs every rank shares (the step's global token counts, the plan,
//! the all-reduced step time and cost of the last round), so senders and receivers agree without
//! a message.

pub mod pace;
pub mod selection;

pub use pace::{RoundCost, SnapshotPace, SNAPSHOT_CPU_SHARE};
pub use selection::{nodes_holding, select_snapshots, SnapshotPolicy, SnapshotSelection};
