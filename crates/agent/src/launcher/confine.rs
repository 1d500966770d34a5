//! How much of the machine each worker process gets, so that a worker stands for one
//! accelerator of its own: pinned to cores, or capped by a cgroup CPU quota.

use lazarus_setting::Setting;
use std::path::{Path, PathBuf};
use std::process::Command;

use lazarus_protocol::ControlError;

/// How much of the machine each worker gets. By default workers share every core (an idle
/// rank's core then goes to a busy one, which hides load imbalance).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Confinement {
    Shared,
    /// Worker r pinned to cores [r·C, (r+1)·C), thread pools sized to C.
    Cores(usize),
    /// Each worker in its own Linux cgroup capped at this many CPUs (CFS bandwidth, 10 ms
    /// period), for machines with fewer cores than workers; needs write access to the cgroup
    /// cpu controller (v1 `/sys/fs/cgroup/cpu` or v2 `/sys/fs/cgroup`).
    CpuQuota(f64),
}

/// Per-worker cgroups created for [`Confinement::CpuQuota`]; removed when dropped (once the
/// workers have exited; a cgroup with live processes cannot be removed).
pub struct QuotaGroups {
    pub(crate) dirs: Vec<PathBuf>,
}

impl Drop for QuotaGroups {
    fn drop(&mut self) {
        for d in &self.dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}

impl QuotaGroups {
    pub(crate) fn create(world: usize, cpus: f64) -> Result<Self, ControlError> {
        const PERIOD_US: u64 = 10_000;
        let quota = (cpus * PERIOD_US as f64).round() as u64;
        let v1 = Path::new("/sys/fs/cgroup/cpu");
        let (base, v2) = if v1.join("cpu.cfs_quota_us").exists() {
            (v1.to_path_buf(), false)
        } else if std::fs::read_to_string("/sys/fs/cgroup/cgroup.subtree_control").is_ok_and(|c| c.split_whitespace().any(|x| x == "cpu")) {
            (PathBuf::from("/sys/fs/cgroup"), true)
        } else {
            return Err(ControlError::invalid(
                Setting::CpusPerWorker,
                "no writable cgroup cpu controller (cgroup v1 /sys/fs/cgroup/cpu or v2 with cpu in /sys/fs/cgroup/cgroup.subtree_control)",
            ));
        };
        let mut groups = QuotaGroups { dirs: Vec::with_capacity(world) };
        for rank in 0..world {
            let dir = base.join(format!("lazarus-{}-{rank}", std::process::id()));
            std::fs::create_dir_all(&dir)
                .map_err(|e| ControlError::io(format!("{}: cannot create cgroup {}", Setting::CpusPerWorker, dir.display()), e))?;
            groups.dirs.push(dir.clone());
            let write = |file: &str, value: String| {
                std::fs::write(dir.join(file), &value).map_err(|e| {
                    ControlError::io(format!("{}: cannot write {value:?} to {}", Setting::CpusPerWorker, dir.join(file).display()), e)
                })
            };
            if v2 {
                write("cpu.max", format!("{quota} {PERIOD_US}"))?;
            } else {
                write("cpu.cfs_period_us", PERIOD_US.to_string())?;
                write("cpu.cfs_quota_us", quota.to_string())?;
            }
        }
        Ok(groups)
    }
}

/// Move the child into the cgroup whose `cgroup.procs` is `procs` before it runs any code.
pub(crate) fn join_cgroup(cmd: &mut Command, procs: &Path) -> Result<(), ControlError> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::process::CommandExt;
        let path = std::ffi::CString::new(procs.as_os_str().as_bytes())
            .map_err(|_| ControlError::invalid(Setting::CpusPerWorker, "cgroup path holds a NUL byte"))?;
        // SAFETY: between fork and exec the closure only calls open, write and close on a path
        // built before the fork — all async-signal-safe. Writing "0" moves the calling process.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
                let err = std::io::Error::last_os_error();
                libc::close(fd);
                if ok {
                    Ok(())
                } else {
                    Err(err)
                }
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (cmd, procs);
    Ok(())
}

/// The CPU ids this process may run on, ascending (its affinity mask: a container or `taskset`
/// may allow CPUs 8–15 only); elsewhere than Linux, 0..available_parallelism.
pub fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sched_getaffinity writes at most size_of::<cpu_set_t>() bytes into `set`.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect();
                if !cpus.is_empty() {
                    return cpus;
                }
            }
        }
    }
    (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
}

/// Restrict the child to `cores` (Linux; elsewhere only the thread-pool size applies).
pub(crate) fn pin(cmd: &mut Command, cores: Vec<usize>) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: between fork and exec the closure only builds a CPU set on the stack and calls
        // sched_setaffinity, both async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                for &c in &cores {
                    libc::CPU_SET(c, &mut set);
                }
                if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (cmd, cores);
}

/// What bounds the memory a run may take: the machine's, or a limit set on this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryBound {
    /// Physical memory.
    Machine,
    /// `RLIMIT_AS` (`ulimit -v`, a batch system's virtual-memory limit).
    AddressSpace,
    /// The cgroup's `memory.max` (or v1 `memory.limit_in_bytes`): a container's or a Slurm
    /// job's limit, which kills the process past it.
    Cgroup,
}

impl MemoryBound {
    /// Who allows how much, as an error says it: "… needs 3.1 GiB and {this} 2.0 GiB".
    pub fn says(self) -> &'static str {
        match self {
            MemoryBound::Machine => "this machine has",
            MemoryBound::AddressSpace => "the address-space limit (RLIMIT_AS, ulimit -v) allows",
            MemoryBound::Cgroup => "the cgroup's memory limit (memory.max: a container's or a job's) allows",
        }
    }
}

/// The memory this process may use in bytes, and what bounds it: the least of the machine's
/// physical memory, the address-space limit and the cgroup's limit (of its cgroup and every
/// cgroup above it). None when none of them can be read.
pub fn memory_available() -> Option<(u64, MemoryBound)> {
    tightest([
        (physical_memory(), MemoryBound::Machine),
        (address_space_limit(), MemoryBound::AddressSpace),
        (cgroup_memory_limit(), MemoryBound::Cgroup),
    ])
}

/// The least of the bounds known.
fn tightest(bounds: impl IntoIterator<Item = (Option<u64>, MemoryBound)>) -> Option<(u64, MemoryBound)> {
    bounds.into_iter().filter_map(|(b, kind)| b.map(|b| (b, kind))).min_by_key(|&(b, _)| b)
}

/// `RLIMIT_AS`'s soft limit, unless unlimited.
fn address_space_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes the struct it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut r) } == 0 && r.rlim_cur != libc::RLIM_INFINITY {
            return Some(r.rlim_cur);
        }
    }
    None
}

/// The tightest memory limit of this process's cgroup and the cgroups above it (cgroup v2),
/// else cgroup v1's.
fn cgroup_memory_limit() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let read = |p: &str| std::fs::read_to_string(p).ok().and_then(|t| parse_memory_limit(&t));
    match cgroup_v2_path(&own) {
        Some(path) => cgroup_ancestors(&path).iter().filter_map(|dir| read(&format!("/sys/fs/cgroup{dir}/memory.max"))).min(),
        None => read("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
    }
}

/// The cgroup v2 path in `/proc/self/cgroup`'s text (its `0::/path` line).
fn cgroup_v2_path(text: &str) -> Option<String> {
    text.lines().find_map(|l| l.strip_prefix("0::")).map(|p| p.trim().to_string())
}

/// `path` and each cgroup above it, up to the root (`""`): `/a/b` gives `/a/b`, `/a`, ``.
fn cgroup_ancestors(path: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut p = path.trim_end_matches('/').to_string();
    loop {
        out.push(p.clone());
        match p.rfind('/') {
            Some(i) => p.truncate(i),
            None => break,
        }
        if p.is_empty() {
            out.push(String::new());
            break;
        }
    }
    out.dedup();
    out
}

/// A limit file's bytes: `max` (v2) or v1's "unlimited" (near 2^63) is no limit.
fn parse_memory_limit(text: &str) -> Option<u64> {
    let t = text.trim();
    if t == "max" {
        return None;
    }
    t.parse::<u64>().ok().filter(|&v| v < 1 << 60)
}

/// Physical memory of this machine in bytes (Linux and other Unixes with `_SC_PHYS_PAGES`).
pub fn physical_memory() -> Option<u64> {
    #[cfg(unix)]
    {
        // SAFETY: sysconf only reads system configuration.
        let (pages, size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
        if pages > 0 && size > 0 {
            return Some(pages as u64 * size as u64);
        }
    }
    None
}

#[cfg(test)]
mod memory_tests {
    use super::*;

    /// The tightest known bound wins; unreadable ones are left out; a limit file's "max" or
    /// v1's huge "unlimited" is none; the cgroup path and its ancestors are read from
    /// /proc/self/cgroup's v2 line.
    #[test]
    fn the_tightest_memory_bound_is_the_one_named() {
        use MemoryBound::*;
        let gib = 1u64 << 30;
        assert_eq!(tightest([(Some(24 * gib), Machine), (Some(2 * gib), AddressSpace), (None, Cgroup)]), Some((2 * gib, AddressSpace)));
        assert_eq!(tightest([(Some(24 * gib), Machine), (None, AddressSpace), (Some(8 * gib), Cgroup)]), Some((8 * gib, Cgroup)));
        assert_eq!(tightest([(None, Machine), (None, AddressSpace), (None, Cgroup)]), None);
        assert_eq!(parse_memory_limit("max\n"), None);
        assert_eq!(parse_memory_limit("9223372036854771712\n"), None);
        assert_eq!(parse_memory_limit("2147483648\n"), Some(2 * gib));
        assert_eq!(parse_memory_limit("garbage"), None);
        assert_eq!(cgroup_v2_path("12:memory:/x\n0::/user.slice/job-7\n").as_deref(), Some("/user.slice/job-7"));
        assert_eq!(cgroup_v2_path("4:memory:/docker/abc\n"), None);
        assert_eq!(cgroup_ancestors("/user.slice/job-7"), vec!["/user.slice/job-7".to_string(), "/user.slice".into(), String::new()]);
        assert_eq!(cgroup_ancestors("/"), vec![String::new()]);
        // What this process sees is one of them, no more than the machine.
        let (b, _) = memory_available().expect("a Linux machine says its memory");
        assert!(b <= physical_memory().unwrap());
    }
}
