//! The settings a user gives a job, named once.
//!
//! A library that refuses a value, or hints at what to change, names the setting by
//! [`Setting`], never by how one front end spells it: the CLI spells settings as flags
//! (`--tls-cert`), a `--config` file as keys of a table (`tls_cert`), and another front end may
//! do otherwise. The front end says how once, at start ([`spell_settings_as`]); every message
//! of every library below it then names the setting the user's way. Unset (a library's own
//! tests), a setting is shown by its [`Setting::key`].

use std::fmt;
use std::sync::OnceLock;

macro_rules! settings {
    ($($variant:ident => $key:literal,)*) => {
        /// A setting of a job or of one of its processes, as a user gives it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Setting {
            $($variant,)*
        }

        impl Setting {
            /// Every setting, in declaration order.
            pub const ALL: &'static [Setting] = &[$(Setting::$variant,)*];

            /// The setting's key, in snake case: how a configuration table names it.
            pub const fn key(self) -> &'static str {
                match self {
                    $(Setting::$variant => $key,)*
                }
            }
        }
    };
}

settings! {
    // The job's shape and its workers.
    Workers => "workers",
    GpusPerNode => "gpus_per_node",
    MaxWorkers => "max_workers",
    SlotsPerWorker => "slots_per_worker",
    PlacementFile => "placement_file",
    ProfileSteps => "profile_steps",
    StaticEp => "static_ep",
    Recovery => "recovery",
    Device => "device",
    // Training.
    Lr => "lr",
    Steps => "steps",
    CheckpointDir => "checkpoint_dir",
    CheckpointEvery => "checkpoint_every",
    Resume => "resume",
    ResumeJob => "resume_job",
    // Model blocks.
    Norm => "norm",
    Positions => "positions",
    ExpertAct => "expert_act",
    AttnBias => "attn_bias",
    QkvBias => "qkv_bias",
    SharedExpertGate => "shared_expert_gate",
    FfnBias => "ffn_bias",
    Balance => "balance",
    // The controller and its endpoints.
    Controller => "controller",
    Listen => "listen",
    StatusListen => "status_listen",
    MetricsListen => "metrics_listen",
    DashboardListen => "dashboard_listen",
    Lease => "lease",
    Heartbeat => "heartbeat",
    Replay => "replay",
    // Security.
    SecretFile => "secret_file",
    TlsCert => "tls_cert",
    TlsKey => "tls_key",
    TlsCa => "tls_ca",
    EncryptData => "encrypt_data",
    // A node agent and its workers.
    Gpus => "gpus",
    Host => "host",
    CoresPerWorker => "cores_per_worker",
    CpusPerWorker => "cpus_per_worker",
    CommTimeout => "comm_timeout",
    ConnectTimeout => "connect_timeout",
    ControllerGrace => "controller_grace",
    // The recovery benchmark.
    Kills => "kills",
}

static SPELLING: OnceLock<fn(Setting) -> String> = OnceLock::new();

/// How this process's front end spells a setting to its user; the first call decides (a front
/// end says it once, before any library speaks). False when another spelling was set first.
pub fn spell_settings_as(spell: fn(Setting) -> String) -> bool {
    SPELLING.set(spell).is_ok()
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match SPELLING.get() {
            Some(spell) => f.write_str(&spell(*self)),
            None => f.write_str(self.key()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_distinct_snake_case_words() {
        let mut keys: Vec<&str> = Setting::ALL.iter().map(|s| s.key()).collect();
        assert!(keys.iter().all(|k| !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')), "{keys:?}");
        keys.sort_unstable();
        let n = keys.len();
        keys.dedup();
        assert_eq!(keys.len(), n, "a key named twice");
    }

    #[test]
    fn a_setting_is_shown_by_its_key_until_a_front_end_spells_it_and_then_its_way() {
        // One test sets the spelling: the process keeps it.
        assert_eq!(Setting::TlsCert.to_string(), "tls_cert");
        assert!(spell_settings_as(|s| format!("<{}>", s.key())));
        assert_eq!(Setting::TlsCert.to_string(), "<tls_cert>");
        assert!(!spell_settings_as(|s| s.key().to_uppercase()), "the first spelling decides");
        assert_eq!(format!("{}", Setting::GpusPerNode), "<gpus_per_node>");
    }
}
