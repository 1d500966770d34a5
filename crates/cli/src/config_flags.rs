//! The `[controller]` and `[agent]` tables of a `--config` file are flags: each key is a long
//! flag of that command with `_` for `-` (`max_workers = 64` is `--max-workers 64`), each value
//! its value (`true` turns a switch on, `false` leaves it as the command line says). They go
//! before the command line's own arguments, and an option given twice keeps its last value, so
//! a flag given overrides the file. Every setting is defined once — its clap argument, with
//! its parser and its checks — and a key that is no flag of the command is refused by name.

use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use lazarus_setting::Setting;

/// A setting as this command line spells it: its long flag, the key with `-` for `_` (what
/// every library's messages show once `main` says so; `every_setting_is_a_flag` holds each
/// to a flag some command has).
pub fn flag(setting: Setting) -> String {
    format!("--{}", setting.key().replace('_', "-"))
}

/// The commands that read a table of their own from `--config`.
const TABLES: [&str; 2] = ["controller", "agent"];

/// Flags that are one setting between them: a command line that gives any of them replaces
/// whatever the file says of all of them (a fixed snapshot budget, or the paced default's
/// ceiling).
const ONE_SETTING: [&[&str]; 1] = [&["snapshot-bandwidth", "snapshot-ceiling"]];

/// `argv` (the program, its subcommand, the subcommand's arguments) with the flags of the
/// subcommand's `--config` table put before its own arguments; `cli` is the whole command line
/// interface, whose subcommand's arguments the keys must name.
pub fn with_config_tables(cli: &clap::Command, argv: Vec<OsString>) -> Result<Vec<OsString>> {
    let Some(name) = argv.get(1).and_then(|s| s.to_str()).filter(|s| TABLES.contains(s)) else { return Ok(argv) };
    let Some(command) = cli.find_subcommand(name) else { return Ok(argv) };
    // Help needs no file (a unit's command line is checked by asking for it).
    if argv[2..].iter().any(|a| a == "--help" || a == "-h") {
        return Ok(argv);
    }
    let flags = table_flags(command, name, &argv[2..])?;
    let mut out = argv[..2].to_vec();
    out.extend(flags);
    out.extend_from_slice(&argv[2..]);
    Ok(out)
}

/// The flags the `[name]` table of the `--config` file named in `args` stands for (none
/// without one).
pub fn table_flags(command: &clap::Command, name: &str, args: &[OsString]) -> Result<Vec<OsString>> {
    let Some(path) = config_path(args) else { return Ok(Vec::new()) };
    let text = crate::io::read_text("config", &path, 1 << 20)?;
    let mut file: toml::Table = toml::from_str(&text).with_context(|| format!("invalid --config {}", path.display()))?;
    let Some(table) = file.remove(name) else {
        if name == "agent" {
            bail!("invalid --config {}: it has no [agent] table (the agent's settings)", path.display());
        }
        return Ok(Vec::new());
    };
    let toml::Value::Table(table) = table else { bail!("invalid --config {}: [{name}] is not a table", path.display()) };
    let given =
        |flag: &str| args.iter().filter_map(|a| a.to_str()).any(|a| a == format!("--{flag}") || a.starts_with(&format!("--{flag}=")));
    let mut flags = Vec::new();
    for (key, value) in table {
        let flag = key.replace('_', "-");
        let bad = |why: String| anyhow::anyhow!("invalid --config {}: [{name}] {key}: {why}", path.display());
        let Some(arg) = command.get_arguments().find(|a| a.get_long() == Some(flag.as_str()) && flag != "config") else {
            bail!(
                "invalid --config {}: [{name}] has no setting `{key}` (its keys are the flags of lazarus {name}, `_` for `-`)",
                path.display()
            );
        };
        if ONE_SETTING.iter().any(|group| group.contains(&flag.as_str()) && group.iter().any(|f| given(f))) {
            continue;
        }
        let switch = !arg.get_action().takes_values();
        match value {
            toml::Value::Boolean(on) if switch => {
                if on {
                    flags.push(OsString::from(format!("--{flag}")));
                }
            }
            _ if switch => return Err(bad(format!("{value} (expected true or false)"))),
            toml::Value::String(s) => flags.extend([OsString::from(format!("--{flag}")), OsString::from(s)]),
            toml::Value::Integer(_) | toml::Value::Float(_) => {
                flags.extend([OsString::from(format!("--{flag}")), OsString::from(value.to_string())])
            }
            toml::Value::Boolean(on) => flags.extend([OsString::from(format!("--{flag}")), OsString::from(if on { "on" } else { "off" })]),
            other => return Err(bad(format!("{other} (expected a string, a number or true/false)"))),
        }
    }
    Ok(flags)
}

/// The file `--config FILE` (or `--config=FILE`) names among `args`.
fn config_path(args: &[OsString]) -> Option<PathBuf> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--config" {
            return it.next().map(PathBuf::from);
        }
        if let Some(path) = a.to_str().and_then(|a| a.strip_prefix("--config=")) {
            return Some(PathBuf::from(path));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long_flags(command: &clap::Command, into: &mut std::collections::BTreeSet<String>) {
        into.extend(command.get_arguments().filter_map(|a| a.get_long()).map(|l| format!("--{l}")));
        for sub in command.get_subcommands() {
            long_flags(sub, into);
        }
    }

    #[test]
    fn every_setting_is_a_flag_of_some_command() {
        let mut flags = std::collections::BTreeSet::new();
        long_flags(&<crate::Cli as clap::CommandFactory>::command(), &mut flags);
        let strays: Vec<String> = Setting::ALL.iter().map(|&s| flag(s)).filter(|f| !flags.contains(f)).collect();
        assert!(strays.is_empty(), "settings that no command takes: {strays:?}");
        assert_eq!(flag(Setting::GpusPerNode), "--gpus-per-node");
    }
}
