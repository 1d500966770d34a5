//! The systemd units of `deploy/systemd` pass `systemd-analyze verify` (with the binary built
//! here in place of /usr/local/bin/lazarus, and root for the `lazarus` user this machine lacks),
//! and the command lines they start are ones `lazarus` takes. Skipped, saying why, where
//! systemd-analyze is not installed.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn the_systemd_units_verify_and_start_commands_lazarus_takes() {
    if Command::new("systemd-analyze").arg("--version").output().is_err() {
        eprintln!("skipped: systemd-analyze not installed");
        return;
    }
    let d = common::dir("systemd");
    let units = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/systemd");
    let mut paths = Vec::new();
    for name in ["lazarus-controller.service", "lazarus-agent.service"] {
        let text = std::fs::read_to_string(units.join(name)).unwrap();
        let exec = text.lines().find_map(|l| l.strip_prefix("ExecStart=")).unwrap();
        let argv: Vec<&str> = exec.split_whitespace().collect();
        assert_eq!(argv[0], "/usr/local/bin/lazarus", "{name}");
        // The arguments parse (asking for help parses every flag before it).
        let mut help = argv[1..].to_vec();
        help.push("--help");
        let out = common::lazarus(&help);
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let here = text.replace("/usr/local/bin/lazarus", env!("CARGO_BIN_EXE_lazarus")).replace("User=lazarus", "User=root");
        let path = d.join(name);
        std::fs::write(&path, here).unwrap();
        paths.push(path);
    }
    let out = Command::new("systemd-analyze").arg("verify").args(&paths).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.trim().is_empty(), "{err}");
}
