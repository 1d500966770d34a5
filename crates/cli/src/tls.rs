//! The TLS flags of `lazarus controller`, `lazarus agent` and `lazarus status` (one set, read
//! the same way by each). Without them the controller serves a certificate for the key the
//! job's secret gives and clients pin that key (`lazarus_protocol::tls`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use lazarus_protocol::tls::TlsFiles;

/// Largest PEM file read.
const MAX_PEM_BYTES: u64 = 1 << 20;

#[derive(Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// Certificate (PEM) this side presents: the controller's own, or an agent's or status
    /// client's for mutual TLS. Default: the controller makes one for the key its job's secret
    /// gives, which clients holding the secret (or the status token) pin.
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// CA certificate (PEM). On the controller: clients must present a certificate it signed
    /// (mutual TLS). On a client: the controller's certificate must chain to it, for the host
    /// named in --controller.
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The files' contents (each at most 1 MiB of text).
    pub fn files(&self) -> Result<TlsFiles> {
        let read = |flag: &str, path: &Option<PathBuf>| -> Result<Option<Vec<u8>>> {
            path.as_ref().map(|p| crate::io::read_text(flag, p, MAX_PEM_BYTES).map(String::into_bytes)).transpose()
        };
        Ok(TlsFiles {
            cert_pem: read("tls-cert", &self.tls_cert)?,
            key_pem: read("tls-key", &self.tls_key)?,
            ca_pem: read("tls-ca", &self.tls_ca)?,
        })
    }
}
