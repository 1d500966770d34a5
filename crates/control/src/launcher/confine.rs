//! How much of the machine each worker process gets, so that a worker stands for one
//! accelerator of its own: pinned to cores, or capped by a cgroup CPU quota.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::ControlError;

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
                "--cpus-per-worker",
                "no writable cgroup cpu controller (cgroup v1 /sys/fs/cgroup/cpu or v2 with cpu in /sys/fs/cgroup/cgroup.subtree_control)",
            ));
        };
        let mut groups = QuotaGroups { dirs: Vec::with_capacity(world) };
        for rank in 0..world {
            let dir = base.join(format!("lazarus-{}-{rank}", std::process::id()));
            std::fs::create_dir_all(&dir)
                .map_err(|e| ControlError::io(format!("--cpus-per-worker: cannot create cgroup {}", dir.display()), e))?;
            groups.dirs.push(dir.clone());
            let write = |file: &str, value: String| {
                std::fs::write(dir.join(file), &value)
                    .map_err(|e| ControlError::io(format!("--cpus-per-worker: cannot write {value:?} to {}", dir.join(file).display()), e))
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
            .map_err(|_| ControlError::invalid("--cpus-per-worker", "cgroup path holds a NUL byte"))?;
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
