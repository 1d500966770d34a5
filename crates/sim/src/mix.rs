//! Failure mixes taken from published reports of large training runs: what interrupted the job,
//! how often, and — what decides the cost of each for a system that keeps its survivors — how
//! the failure is found out.
//!
//! A failure is found out one of two ways ([`Seen`]):
//!
//! * **by an exit**: the process dies (a GPU's Xid error, an uncorrectable HBM error, a software
//!   fault); the launcher or node agent on its host sees the exit at once and tells the
//!   survivors, who abort their collectives. Every policy is charged
//!   [`crate::CostModel::exit_detect_s`] for it (the same launcher serves them all);
//! * **by silence**: the host, its network or its switch goes (or a collective hangs): nobody
//!   sees an exit, and the job waits for a time-out — a lease or the collective's own —
//!   [`crate::CostModel::failure_timeout_s`].
//!
//! Which of the two a cause is comes from what the cause is (our reading, said per cause below);
//! a trace without a mix has every removal found out by silence, as the paper's cost model has
//! it. A cause is drawn for each removal from the mix's counts by a pure function of the seed,
//! the node and the time, so every policy meets the same causes.

use serde::Serialize;

use crate::error::SimError;

/// How a failure is found out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Seen {
    /// The process exited: seen at once by the launcher on its host.
    Exit,
    /// The host or its network went quiet: found out by a time-out.
    Silence,
}

/// One cause of interruptions in a report, with its count.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Cause {
    pub name: &'static str,
    pub count: u32,
    pub seen: Seen,
}

/// The unexpected interruptions of a published run: their causes, over `gpus` GPUs for `days`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FailureMix {
    pub name: &'static str,
    /// Where the figures come from.
    pub source: &'static str,
    pub gpus: u64,
    pub days: f64,
    pub causes: &'static [Cause],
}

/// Llama 3 405B's pre-training (Dubey et al., *The Llama 3 Herd of Models*, 2024, §3.3.4 and
/// Table 5): 419 unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs (466 with
/// the 47 planned ones, which are left out). Counts as published; the percentages printed beside
/// them there do not all agree with the counts, so the counts are used. Which are seen by an
/// exit is our reading: faults of the GPU itself (Xid errors, HBM or SRAM errors, the GPU's
/// system processor, silent data corruption caught by a check, a thermal trip) and software
/// faults end the process; the network, the host and its parts take the process's host or its
/// links, and a watchdog time-out is a hang by definition.
const LLAMA3: &[Cause] = &[
    Cause { name: "faulty GPU", count: 148, seen: Seen::Exit },
    Cause { name: "GPU HBM3 memory", count: 72, seen: Seen::Exit },
    Cause { name: "software bug", count: 54, seen: Seen::Exit },
    Cause { name: "network switch/cable", count: 35, seen: Seen::Silence },
    Cause { name: "host maintenance", count: 32, seen: Seen::Silence },
    Cause { name: "GPU SRAM memory", count: 19, seen: Seen::Exit },
    Cause { name: "GPU system processor", count: 17, seen: Seen::Exit },
    Cause { name: "NIC", count: 7, seen: Seen::Silence },
    Cause { name: "NCCL watchdog time-out", count: 7, seen: Seen::Silence },
    Cause { name: "silent data corruption", count: 6, seen: Seen::Exit },
    Cause { name: "GPU thermal interface and sensor", count: 6, seen: Seen::Exit },
    Cause { name: "SSD", count: 3, seen: Seen::Silence },
    Cause { name: "power supply", count: 3, seen: Seen::Silence },
    Cause { name: "server chassis", count: 2, seen: Seen::Silence },
    Cause { name: "IO expansion board", count: 2, seen: Seen::Silence },
    Cause { name: "dependency", count: 2, seen: Seen::Exit },
    Cause { name: "CPU", count: 2, seen: Seen::Silence },
    Cause { name: "system memory", count: 2, seen: Seen::Silence },
];

impl FailureMix {
    /// The mixes there are: `llama3`.
    pub fn preset(name: &str) -> Result<Self, SimError> {
        match name {
            "llama3" => Ok(FailureMix {
                name: "llama3",
                source: "Llama 3 405B pre-training: 419 unexpected interruptions in 54 days on 16,384 H100s (Dubey et al. 2024, Table 5)",
                gpus: 16_384,
                days: 54.0,
                causes: LLAMA3,
            }),
            other => Err(SimError::invalid("failure_mix", other, "expected llama3")),
        }
    }

    pub fn interruptions(&self) -> u32 {
        self.causes.iter().map(|c| c.count).sum()
    }

    /// Interruptions per GPU per day.
    pub fn per_gpu_day(&self) -> f64 {
        f64::from(self.interruptions()) / (self.gpus as f64 * self.days)
    }

    /// The mean time between failures of one node of `gpus_per_node` GPUs at the report's rate,
    /// in milliseconds (a failure of any of its GPUs takes the node: plans hold whole nodes).
    pub fn node_mtbf_ms(&self, gpus_per_node: usize) -> f64 {
        86_400_000.0 / (self.per_gpu_day() * gpus_per_node.max(1) as f64)
    }

    /// The share of interruptions found out by an exit.
    pub fn exit_share(&self) -> f64 {
        let exits: u32 = self.causes.iter().filter(|c| c.seen == Seen::Exit).map(|c| c.count).sum();
        f64::from(exits) / f64::from(self.interruptions().max(1))
    }

    /// The cause of the removal of `node` at `ms`: drawn from the counts by a pure function of
    /// the seed, the node and the time (every policy meets the same causes).
    pub fn cause_of(&self, seed: u64, node: &str, ms: u64) -> &Cause {
        let mut h = seed ^ 0x6d69_7863_6175_7365 ^ ms.rotate_left(29);
        for b in node.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        let draw = (lazarus_plan::rng::SplitMix64::new(h).uniform() * f64::from(self.interruptions())) as u32;
        let mut below = 0;
        for c in self.causes {
            below += c.count;
            if draw < below {
                return c;
            }
        }
        &self.causes[self.causes.len() - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_llama3_mix_has_the_reports_counts_and_rate() {
        let m = FailureMix::preset("llama3").unwrap();
        assert_eq!(m.interruptions(), 419, "the unexpected interruptions of Table 5");
        // 419 in 54 days on 16,384 GPUs: about one every 3.1 hours there, one every 2 days on 1,024.
        let per_day_on_1024 = m.per_gpu_day() * 1024.0;
        assert!((per_day_on_1024 - 0.485).abs() < 0.001, "{per_day_on_1024}");
        let node_days = m.node_mtbf_ms(8) / 86_400_000.0;
        assert!((node_days - 263.9).abs() < 0.1, "{node_days}");
        let exits = m.exit_share();
        assert!((exits - 324.0 / 419.0).abs() < 1e-12, "{exits}");
        assert!(FailureMix::preset("meta").unwrap_err().to_string().contains("expected llama3"));
    }

    /// The draws follow the counts and are the same for the same removal.
    #[test]
    fn causes_are_drawn_by_their_counts_and_repeat_for_the_same_removal() {
        let m = FailureMix::preset("llama3").unwrap();
        let n = 20_000u64;
        let exits = (0..n).filter(|&i| m.cause_of(7, &format!("n{}", i % 97), i * 1000).seen == Seen::Exit).count();
        let share = exits as f64 / n as f64;
        assert!((share - m.exit_share()).abs() < 0.02, "{share} against {}", m.exit_share());
        let gpu = (0..n).filter(|&i| m.cause_of(7, &format!("n{}", i % 97), i * 1000).name == "faulty GPU").count();
        assert!((gpu as f64 / n as f64 - 148.0 / 419.0).abs() < 0.02);
        assert_eq!(m.cause_of(3, "n5", 60_000), m.cause_of(3, "n5", 60_000));
    }
}
