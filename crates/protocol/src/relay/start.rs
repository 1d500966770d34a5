//! The start of a node's workers as node agents carry it: the controller sends each agent one
//! [`proto::StartWorkers`] — a typed slot per worker, the job once, compressed — and the agent
//! makes each worker's spec line ([`WorkerSpec`]) from it: the slot, the secret the agent
//! proved (never on the network), and the job as it came (megabytes at a thousand nodes: handed
//! on unread, not parsed into a tree).

use serde_json::value::RawValue;

use super::{bad, BadMessage};
use crate::messages::{secret_hex, WorkerSpec};
use crate::proto;

/// A worker's slot as the controller sends it (its spec less the secret and the job).
pub fn slot_to_proto(rank: usize, world: usize, epoch: u64, timeout_s: f64, bind: &str, encrypt: bool) -> proto::WorkerSlot {
    proto::WorkerSlot { rank: rank as u64, world: world as u64, epoch, timeout_s, bind: bind.to_string(), encrypt }
}

/// The ranks (worker ids, for workers that stand by) of a start's slots, in slot order: each
/// below [`crate::MAX_WORKERS`] (a worker id counts every worker the job ever had, so it may
/// pass the most at once; not a word a peer may stretch).
pub fn ranks(start: &proto::StartWorkers) -> Result<Vec<u32>, BadMessage> {
    start.workers.iter().map(|w| id("rank", w.rank)).collect()
}

/// A rank or world from the wire: at most `MAX_WORKERS` × 1,024 (the workers of a long job's
/// joins and returns included).
fn id(field: &'static str, n: u64) -> Result<u32, BadMessage> {
    let most = crate::MAX_WORKERS as u64 * 1024;
    u32::try_from(n).ok().filter(|&x| u64::from(x) <= most).ok_or_else(|| bad(field, format!("{n} (expected at most {most})")))
}

/// Each worker's spec line (one JSON object, the launcher protocol's first line) for the
/// workers of `start`, with the job's `secret`. Refused: a slot whose rank is not below its
/// world, a job that is not one compressed JSON object.
pub fn spec_lines(start: &proto::StartWorkers, secret: u128) -> Result<Vec<String>, BadMessage> {
    let job = crate::inflate_message(&start.job).map_err(|e| bad("job", e))?;
    let job = RawValue::from_string(job).map_err(|e| bad("job", e.to_string()))?;
    let secret = secret_hex(secret);
    start
        .workers
        .iter()
        .map(|w| {
            let (rank, world) = (id("rank", w.rank)? as usize, id("world", w.world)? as usize);
            if rank >= world {
                return Err(bad("rank", format!("{rank} (expected below the world, {world})")));
            }
            if !w.timeout_s.is_finite() || w.timeout_s <= 0.0 || w.timeout_s > 1e6 {
                return Err(bad("timeout_s", format!("{} (expected seconds above 0, at most 1e6)", w.timeout_s)));
            }
            if !w.bind.is_empty() && w.bind.parse::<std::net::IpAddr>().is_err() {
                return Err(bad("bind", format!("{:?} (expected an IP address)", w.bind)));
            }
            let bind = (!w.bind.is_empty()).then(|| w.bind.clone());
            let spec = WorkerSpec {
                rank,
                world,
                epoch: w.epoch,
                timeout_s: w.timeout_s,
                secret: secret.clone(),
                bind,
                encrypt: w.encrypt,
                job: &*job,
            };
            serde_json::to_string(&spec).map_err(|e| bad("workers", e.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(job: &str, slots: Vec<proto::WorkerSlot>) -> proto::StartWorkers {
        proto::StartWorkers { workers: slots, job: crate::deflate_message(job.as_bytes()).into(), standby: false }
    }

    #[test]
    fn each_worker_gets_its_slot_the_agents_secret_and_the_job_as_it_came() {
        let secret = 0x0123_4567_89ab_cdef_0123_4567_89ab_cdef_u128;
        let job = r#"{"standby":false,"plan":{"layers":[[0,1]]}}"#;
        let s = start(job, vec![slot_to_proto(4, 8, 3, 30.0, "10.0.0.2", true), slot_to_proto(5, 8, 3, 30.0, "", false)]);
        assert_eq!(ranks(&s).unwrap(), vec![4u32, 5]);
        let lines = spec_lines(&s, secret).unwrap();
        let first: WorkerSpec<serde_json::Value> = serde_json::from_str(&lines[0]).unwrap();
        assert_eq!((first.rank, first.world, first.epoch, first.timeout_s, first.encrypt), (4, 8, 3, 30.0, true));
        assert_eq!(first.bind.as_deref(), Some("10.0.0.2"));
        assert_eq!(first.secret, secret_hex(secret));
        assert_eq!(first.job, serde_json::from_str::<serde_json::Value>(job).unwrap());
        assert!(lines[0].contains(job), "the job's text is handed on as it came: {}", lines[0]);
        let second: WorkerSpec<serde_json::Value> = serde_json::from_str(&lines[1]).unwrap();
        assert_eq!((second.rank, second.bind, second.encrypt), (5, None, false));
        assert!(lines.iter().all(|l| !l.contains('\n')), "one line each");
    }

    #[test]
    fn a_start_that_is_not_one_is_refused_naming_the_field() {
        let field = |s: &proto::StartWorkers| spec_lines(s, 7).unwrap_err().field;
        assert_eq!(field(&start("{}", vec![slot_to_proto(8, 8, 0, 1.0, "", false)])), "rank");
        assert_eq!(field(&start("{}", vec![slot_to_proto(0, 1 << 40, 0, 1.0, "", false)])), "world");
        assert_eq!(field(&start("{}", vec![slot_to_proto(0, 1, 0, f64::NAN, "", false)])), "timeout_s");
        assert_eq!(field(&start("{}", vec![slot_to_proto(0, 1, 0, 1.0, "host; rm -rf", false)])), "bind");
        let mut huge = start("{}", vec![slot_to_proto(0, 1, 0, 1.0, "", false)]);
        huge.workers[0].rank = u64::MAX;
        assert_eq!(ranks(&huge).unwrap_err().field, "rank");
        assert_eq!(field(&start("[1, 2]", vec![slot_to_proto(0, 1, 0, 1.0, "", false)])), "job");
        assert_eq!(field(&start("{\"a\":\n1}", vec![])), "job");
        let mut not_zlib = start("{}", vec![]);
        not_zlib.job = b"{}".to_vec().into();
        assert_eq!(field(&not_zlib), "job");
    }
}
