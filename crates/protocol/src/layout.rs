//! How many workers a job has and how they group into nodes, checked once where the job is made
//! (its flags or its config file) and handed on as [`Workers`], so that nothing below checks
//! them again: the planner, the controller and the launcher take the type, not two numbers.

use crate::error::ControlError;
use lazarus_setting::Setting;

/// Most workers of one job, over all its nodes (1,024 nodes of 16 GPUs).
pub const MAX_WORKERS: usize = 16_384;

/// Most worker processes one machine starts: a node agent's slots (its GPUs), or every worker
/// of a job whose workers all run where it is launched (`train --workers N`).
pub const MAX_WORKERS_PER_HOST: usize = 64;

/// Where a job's workers run, which bounds how many it may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// All on the machine that launches them (its own processes or local agents'):
    /// at most [`MAX_WORKERS_PER_HOST`].
    OneMachine,
    /// On node agents of other hosts: at most [`MAX_WORKERS`].
    Agents,
}

impl Reach {
    /// The most workers a job of this reach may have.
    pub fn most(self) -> usize {
        match self {
            Reach::OneMachine => MAX_WORKERS_PER_HOST,
            Reach::Agents => MAX_WORKERS,
        }
    }
}

/// A job's workers: `world` of them, `gpus_per_node` to a node (a node's workers are its GPUs).
/// Made only by [`Workers::new`], so a value is one that can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workers {
    world: usize,
    gpus_per_node: usize,
}

impl Workers {
    /// `world` workers in nodes of `gpus_per_node`, where `reach` says: 1 to `reach.most()`
    /// workers (`--workers`), nodes of 1 to [`MAX_WORKERS_PER_HOST`] that divide them
    /// (`--gpus-per-node`: every agent brings that many).
    pub fn new(world: usize, gpus_per_node: usize, reach: Reach) -> Result<Self, ControlError> {
        let most = reach.most();
        if world == 0 || world > most {
            let on = if reach == Reach::OneMachine { " on one machine" } else { "" };
            return Err(ControlError::invalid(Setting::Workers, format!("{world} (expected 1 to {most}{on})")));
        }
        if gpus_per_node == 0 || !world.is_multiple_of(gpus_per_node) {
            return Err(ControlError::invalid(
                Setting::GpusPerNode,
                format!("{gpus_per_node} (expected a divisor of {} {world}; every agent brings that many)", Setting::Workers),
            ));
        }
        Ok(Workers { world, gpus_per_node: node_gpus(Setting::GpusPerNode, gpus_per_node)? })
    }

    /// Every worker of the job.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Workers (GPUs) of a node.
    pub fn gpus_per_node(&self) -> usize {
        self.gpus_per_node
    }

    pub fn nodes(&self) -> usize {
        self.world / self.gpus_per_node
    }

    /// The most workers the job may grow to as agents join (`--max-workers`; None: no more than
    /// it starts with): from its workers to [`MAX_WORKERS`], whole nodes.
    pub fn most_workers(&self, max: Option<usize>) -> Result<usize, ControlError> {
        let (world, g) = (self.world, self.gpus_per_node);
        let max = max.unwrap_or(world);
        if max < world || max > MAX_WORKERS || !max.is_multiple_of(g) {
            return Err(ControlError::invalid(
                Setting::MaxWorkers,
                format!("{max} (expected from {} {world} to {MAX_WORKERS}, a multiple of {} {g})", Setting::Workers, Setting::GpusPerNode),
            ));
        }
        Ok(max)
    }
}

/// `gpus` checked as the workers (GPUs) of one node: 1 to [`MAX_WORKERS_PER_HOST`]; `field` is
/// the setting that gave it (an agent's `--gpus`, a job's `--gpus-per-node`).
pub fn node_gpus(field: Setting, gpus: usize) -> Result<usize, ControlError> {
    if gpus == 0 || gpus > MAX_WORKERS_PER_HOST {
        return Err(ControlError::invalid(field, format!("{gpus} (expected 1 to {MAX_WORKERS_PER_HOST})")));
    }
    Ok(gpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(r: Result<impl std::fmt::Debug, ControlError>, field: Setting) -> String {
        match r {
            Err(ControlError::Invalid { setting, reason }) if setting == field => reason,
            other => panic!("expected {field} refused, got {other:?}"),
        }
    }

    #[test]
    fn workers_are_bounded_by_where_they_run_and_make_whole_nodes() {
        let w = Workers::new(12, 4, Reach::OneMachine).unwrap();
        assert_eq!((w.world(), w.gpus_per_node(), w.nodes()), (12, 4, 3));
        assert!(refused(Workers::new(0, 1, Reach::Agents), Setting::Workers).contains("expected 1 to 16384"));
        assert!(refused(Workers::new(65, 1, Reach::OneMachine), Setting::Workers).contains("expected 1 to 64 on one machine"));
        assert_eq!(Workers::new(MAX_WORKERS, 16, Reach::Agents).unwrap().nodes(), 1024);
        assert!(refused(Workers::new(MAX_WORKERS + 1, 1, Reach::Agents), Setting::Workers).contains("16384"));
        assert!(
            refused(Workers::new(12, 5, Reach::Agents), Setting::GpusPerNode).contains(&format!("a divisor of {} 12", Setting::Workers))
        );
        assert!(refused(Workers::new(12, 0, Reach::Agents), Setting::GpusPerNode).contains("0 (expected a divisor"));
        assert!(refused(Workers::new(256, 128, Reach::Agents), Setting::GpusPerNode).contains("expected 1 to 64"));
    }

    #[test]
    fn a_job_grows_in_whole_nodes_up_to_the_bound() {
        let w = Workers::new(8, 4, Reach::Agents).unwrap();
        assert_eq!(w.most_workers(None).unwrap(), 8);
        assert_eq!(w.most_workers(Some(16)).unwrap(), 16);
        for bad in [4, 10, MAX_WORKERS + 4] {
            assert!(
                refused(w.most_workers(Some(bad)), Setting::MaxWorkers).contains(&format!("a multiple of {} 4", Setting::GpusPerNode)),
                "{bad}"
            );
        }
        assert_eq!(refused(node_gpus(Setting::Gpus, 65), Setting::Gpus), "65 (expected 1 to 64)");
    }
}
