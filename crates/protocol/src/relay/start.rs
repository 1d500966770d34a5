//! The start of a node's workers as node agents carry it: the controller sends each agent one
//! [`proto::StartWorkers`] — a typed slot per worker, the job once ([`proto::TrainJob`],
//! encoded and compressed once for every node) — and the agent makes each worker's spec line
//! ([`WorkerSpec`], the launcher protocol's first line) from it: the slot, the secret the agent
//! proved (never on the network), and the job, checked once here.

use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use lazarus_model::TrainConfig;
use lazarus_runtime::SnapshotSettings;
use prost::Message as _;
use serde_json::value::RawValue;

use super::orders::{replica_map, replica_map_of};
use super::{bad, word, BadMessage};
use crate::messages::{secret_hex, HeldOut, TrainJob, WorkerSpec};
use crate::proto;

/// The job as a start carries it ([`proto::StartWorkers::job`]): encoded and compressed once,
/// for every node. Err: settings that have no `--config` form (none today).
pub fn encode_job(job: &TrainJob) -> Result<Vec<u8>, BadMessage> {
    let settings = job.config.to_toml().map_err(|e| bad("job.settings", e.to_string()))?;
    let message = proto::TrainJob {
        settings,
        plan: Some(replica_map(&job.plan)),
        static_ep: job.static_ep,
        deterministic: job.deterministic,
        shard_sequences: job.shard_sequences.map(|n| n as u64),
        resume: job.resume.as_ref().map(|p| p.as_os_str().as_bytes().to_vec()),
        heartbeat_s: job.heartbeat_s,
        faults: job.faults.clone(),
        standby: job.standby,
        snapshots: job.snapshots.as_ref().map(|s| proto::SnapshotSettings {
            gpus_per_node: s.gpus_per_node as u64,
            bandwidth: s.bandwidth,
            adaptive: s.adaptive,
        }),
        device: job.device.clone(),
        encrypt_data: job.encrypt_data,
        held_out: job.held_out.as_ref().map(|h| proto::HeldOut { tokens: h.tokens.clone(), every: h.every, windows: h.windows as u64 }),
    };
    Ok(crate::deflate_message(&message.encode_to_vec()))
}

/// The job a start carries, checked: compressed protobuf of at most
/// [`crate::MAX_INFLATED_BYTES`], settings a `--config` file could hold, a replica map as every
/// map is checked, numbers within this machine's words.
pub fn decode_job(deflated: &[u8]) -> Result<TrainJob, BadMessage> {
    let bytes = crate::inflate_bytes(deflated).map_err(|e| bad("job", e))?;
    let job = proto::TrainJob::decode(&bytes[..]).map_err(|e| bad("job", format!("not a TrainJob ({e})")))?;
    let config = TrainConfig::from_toml(&job.settings).map_err(|e| bad("job.settings", e.to_string()))?;
    let finite = |field: &'static str, x: f64| {
        if x.is_finite() && x >= 0.0 {
            Ok(x)
        } else {
            Err(bad(field, format!("{x} (expected a finite number, at least 0)")))
        }
    };
    let snapshots = match job.snapshots {
        Some(s) => Some(SnapshotSettings {
            gpus_per_node: word("job.snapshots.gpus_per_node", s.gpus_per_node)?,
            bandwidth: finite("job.snapshots.bandwidth", s.bandwidth)?,
            adaptive: s.adaptive,
        }),
        None => None,
    };
    let held_out = match job.held_out {
        Some(h) => Some(HeldOut { tokens: h.tokens, every: h.every, windows: word("job.held_out.windows", h.windows)? }),
        None => None,
    };
    Ok(TrainJob {
        config,
        plan: replica_map_of(job.plan.ok_or_else(|| bad("job.plan", "missing"))?)?,
        static_ep: job.static_ep,
        deterministic: job.deterministic,
        shard_sequences: job.shard_sequences.map(|n| word("job.shard_sequences", n)).transpose()?,
        resume: job.resume.map(|p| PathBuf::from(std::ffi::OsString::from_vec(p))),
        heartbeat_s: finite("job.heartbeat_s", job.heartbeat_s)?,
        faults: job.faults,
        standby: job.standby,
        snapshots,
        device: job.device,
        encrypt_data: job.encrypt_data,
        held_out,
    })
}

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
/// workers of `start`, with the job's `secret`; the job is checked and written once for all of
/// them. Refused: a slot whose rank is not below its world, a job that is not one
/// ([`decode_job`]).
pub fn spec_lines(start: &proto::StartWorkers, secret: u128) -> Result<Vec<String>, BadMessage> {
    let job = decode_job(&start.job)?;
    let job = serde_json::to_string(&job).and_then(RawValue::from_string).map_err(|e| bad("job", e.to_string()))?;
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
    use lazarus_plan::ReplicaMap;

    fn job() -> TrainJob {
        let mut config = TrainConfig { steps: 7, grad_clip: None, seed: 11, ..TrainConfig::default() };
        config.model.n_experts = 3;
        config.model.capacity_factor = Some(1.25);
        TrainJob {
            config,
            plan: ReplicaMap::new(4, vec![vec![vec![1, 2, 0], vec![0, 1, 1]]]).unwrap(),
            static_ep: true,
            deterministic: true,
            shard_sequences: Some(2),
            resume: Some(PathBuf::from("/runs/20261129-130000")),
            heartbeat_s: 0.5,
            faults: "1:forward:3".into(),
            standby: false,
            snapshots: Some(SnapshotSettings { gpus_per_node: 2, bandwidth: 1e9, adaptive: true }),
            device: "cuda:1".into(),
            encrypt_data: true,
            held_out: Some(HeldOut { tokens: vec![5, 0, u32::MAX], every: Some(3), windows: 2 }),
        }
    }

    fn start(job: Vec<u8>, slots: Vec<proto::WorkerSlot>) -> proto::StartWorkers {
        proto::StartWorkers { workers: slots, job: job.into(), standby: false }
    }

    fn json(x: &impl serde::Serialize) -> serde_json::Value {
        serde_json::to_value(x).unwrap()
    }

    #[test]
    fn a_job_comes_back_as_it_was_sent() {
        let sent = job();
        assert_eq!(json(&decode_job(&encode_job(&sent).unwrap()).unwrap()), json(&sent));
        let bare = TrainJob { snapshots: None, held_out: None, resume: None, shard_sequences: None, ..job() };
        assert_eq!(json(&decode_job(&encode_job(&bare).unwrap()).unwrap()), json(&bare));
    }

    #[test]
    fn each_worker_gets_its_slot_the_agents_secret_and_the_job() {
        let secret = 0x0123_4567_89ab_cdef_0123_4567_89ab_cdef_u128;
        let s = start(
            encode_job(&job()).unwrap(),
            vec![slot_to_proto(4, 8, 3, 30.0, "10.0.0.2", true), slot_to_proto(5, 8, 3, 30.0, "", false)],
        );
        assert_eq!(ranks(&s).unwrap(), vec![4u32, 5]);
        let lines = spec_lines(&s, secret).unwrap();
        let first: WorkerSpec<TrainJob> = serde_json::from_str(&lines[0]).unwrap();
        assert_eq!((first.rank, first.world, first.epoch, first.timeout_s, first.encrypt), (4, 8, 3, 30.0, true));
        assert_eq!(first.bind.as_deref(), Some("10.0.0.2"));
        assert_eq!(first.secret, secret_hex(secret));
        assert_eq!(json(&first.job), json(&job()));
        let second: WorkerSpec<serde_json::Value> = serde_json::from_str(&lines[1]).unwrap();
        assert_eq!((second.rank, second.bind, second.encrypt), (5, None, false));
        assert!(lines.iter().all(|l| !l.contains('\n')), "one line each");
    }

    #[test]
    fn a_start_that_is_not_one_is_refused_naming_the_field() {
        let good = encode_job(&job()).unwrap();
        let field = |s: &proto::StartWorkers| spec_lines(s, 7).unwrap_err().field;
        assert_eq!(field(&start(good.clone(), vec![slot_to_proto(8, 8, 0, 1.0, "", false)])), "rank");
        assert_eq!(field(&start(good.clone(), vec![slot_to_proto(0, 1 << 40, 0, 1.0, "", false)])), "world");
        assert_eq!(field(&start(good.clone(), vec![slot_to_proto(0, 1, 0, f64::NAN, "", false)])), "timeout_s");
        assert_eq!(field(&start(good.clone(), vec![slot_to_proto(0, 1, 0, 1.0, "host; rm -rf", false)])), "bind");
        let mut huge = start(good, vec![slot_to_proto(0, 1, 0, 1.0, "", false)]);
        huge.workers[0].rank = u64::MAX;
        assert_eq!(ranks(&huge).unwrap_err().field, "rank");
        assert_eq!(field(&start(b"{}".to_vec(), vec![])), "job", "not zlib");
        assert_eq!(field(&start(crate::deflate_message(b"\xff\xff\xff"), vec![])), "job", "not protobuf");
    }

    #[test]
    fn a_job_that_is_not_one_is_refused_naming_the_field() {
        let refused = |change: &dyn Fn(&mut proto::TrainJob)| {
            let mut message = proto::TrainJob::decode(&crate::inflate_bytes(&encode_job(&job()).unwrap()).unwrap()[..]).unwrap();
            change(&mut message);
            decode_job(&crate::deflate_message(&message.encode_to_vec())).unwrap_err()
        };
        let e = refused(&|j| j.settings.push_str("\nlearning_rate = 3\n"));
        assert_eq!(e.field, "job.settings");
        assert!(e.reason.contains("learning_rate"), "the unknown key named: {e}");
        assert_eq!(refused(&|j| j.settings = "steps = \"many\"".into()).field, "job.settings");
        assert_eq!(refused(&|j| j.plan = None).field, "job.plan");
        assert_eq!(refused(&|j| j.plan.as_mut().unwrap().ranks = 1).field, "plan");
        assert_eq!(refused(&|j| j.heartbeat_s = f64::INFINITY).field, "job.heartbeat_s");
        assert_eq!(refused(&|j| j.snapshots.as_mut().unwrap().bandwidth = -1.0).field, "job.snapshots.bandwidth");
    }
}
