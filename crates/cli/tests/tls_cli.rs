//! TLS with an operator's certificates (`--tls-cert/--tls-key/--tls-ca`): a controller that
//! asks for client certificates (mutual TLS) takes the agents and status clients its CA signed,
//! and no one else — not a client without a certificate, not one of another CA, not one that
//! pins the key of the job's secret instead of checking the CA. (The default, a certificate the
//! job's secret pins, is what every other end-to-end test runs on.)

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::hosts::start_controller;
use common::{dir, files, lazarus, log, spawn_lazarus, wait, written};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

/// A certificate and its key written as `name.pem` and `name-key.pem` in `d`.
fn write(d: &Path, name: &str, cert: &rcgen::Certificate, key: &KeyPair) -> (String, String) {
    let (c, k) = (d.join(format!("{name}.pem")), d.join(format!("{name}-key.pem")));
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    (c.to_str().unwrap().to_string(), k.to_str().unwrap().to_string())
}

/// A CA named `name` and a certificate it signed for each of `leaves` (name, subject names).
fn pki(d: &Path, name: &str, leaves: &[(&str, &[&str])]) -> (PathBuf, Vec<(String, String)>) {
    let ca_key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    let ca = params.self_signed(&ca_key).unwrap();
    write(d, name, &ca, &ca_key);
    let issuer = Issuer::new(params, ca_key);
    let leaves = leaves
        .iter()
        .map(|(leaf, names)| {
            let key = KeyPair::generate().unwrap();
            let mut p = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
            p.distinguished_name.push(DnType::CommonName, *leaf);
            write(d, leaf, &p.signed_by(&key, &issuer).unwrap(), &key)
        })
        .collect();
    (d.join(format!("{name}.pem")), leaves)
}

#[test]
fn with_the_operators_certificates_only_clients_its_ca_signed_get_in() {
    let d = dir("tls-mutual");
    let (ca, ours) = pki(&d, "ca", &[("controller", &["127.0.0.1"]), ("agent", &[])]);
    let (_, theirs) = pki(&d, "other-ca", &[("stranger", &[])]);
    let ca = ca.to_str().unwrap().to_string();
    let ((cert, key), (agent_cert, agent_key), (their_cert, their_key)) = (&ours[0], &ours[1], &theirs[0]);
    let [(path, log_s), (_, secret_s)] = files(&d, ["log.jsonl", "secret"]);
    let mut args = vec!["--listen", "127.0.0.1:0", "--secret-file", &secret_s, "--workers", "2", "--gpus-per-node", "2"];
    args.extend(common::tiny_model("4"));
    args.extend(["--steps", "10", "--json-log", &log_s, "--tls-cert", cert, "--tls-key", key, "--tls-ca", &ca]);
    let (mut controller, ctl_lines, addr) = start_controller(&args, None);

    let status = |extra: &[&str]| {
        let mut a = vec!["status", "--controller", &addr, "--secret-file", &secret_s, "--timeout", "5"];
        a.extend(extra);
        lazarus(&a)
    };
    // The CA's client: answered.
    let out = status(&["--tls-ca", &ca, "--tls-cert", agent_cert, "--tls-key", agent_key]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("workers    2 starting (lease"));
    // Without a certificate, with another CA's, or pinning the secret's key: refused.
    for (extra, why) in [
        (vec!["--tls-ca", &ca], "takes only those its CA signed"),
        (vec!["--tls-ca", &ca, "--tls-cert", their_cert, "--tls-key", their_key], "takes only those its CA signed"),
        (vec![], "is not this job's controller"),
    ] {
        let out = status(&extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(why), "{extra:?}: {err}");
    }
    // Its certificate names 127.0.0.1: asked as localhost, it is not the host the client meant.
    let port = addr.rsplit(':').next().unwrap();
    let localhost = format!("localhost:{port}");
    let out = lazarus(&[
        "status",
        "--controller",
        &localhost,
        "--secret-file",
        &secret_s,
        "--tls-ca",
        &ca,
        "--tls-cert",
        agent_cert,
        "--tls-key",
        agent_key,
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("not valid for name"), "{err}");

    // An agent of another CA is refused; the CA's agent runs the job to its end.
    let agent = |cert: &str, key: &str| {
        let a = ["agent", "--controller", &addr, "--gpus", "2", "--secret-file", &secret_s, "--connect-timeout", "5"];
        let mut a: Vec<&str> = a.to_vec();
        a.extend(["--tls-ca", &ca, "--tls-cert", cert, "--tls-key", key]);
        spawn_lazarus(&a, &[])
    };
    let (mut stranger, lines) = agent(their_cert, their_key);
    wait::failure(&mut stranger, &lines, "an agent of another CA", Duration::from_secs(30));
    let (mut ours, lines) = agent(agent_cert, agent_key);
    wait::job_success(&mut controller, &ctl_lines, &path, "the job of the CA's agent");
    wait::success(&mut ours, &lines, "the CA's agent", Duration::from_secs(30));
    assert_eq!(log(&path).0.len(), 10, "every step ran");
}

/// Files that are not certificates, flags that do not go together: refused before anything
/// starts, naming the flag.
#[test]
fn tls_flags_that_cannot_work_are_refused_naming_the_flag() {
    let d = dir("tls-flags");
    let junk = &written(&d, "junk.pem", "not a certificate\n");
    let secret = &written(&d, "secret", "7f3a9c2e5b8d1f4a6c0e9b2d7a5f3c81\n");
    let base = ["controller", "--listen", "127.0.0.1:0", "--workers", "2", "--secret-file", secret];
    for (extra, flag) in [
        (vec!["--tls-cert", junk, "--tls-key", junk], "--tls-cert"),
        (vec!["--tls-key", junk], "--tls-cert"),
        (vec!["--tls-cert", junk], "--tls-key"),
    ] {
        let mut a = base.to_vec();
        a.extend(extra.iter().copied());
        let out = lazarus(&a);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(&format!("invalid {flag}")), "{extra:?}: {err}");
    }
    let out = lazarus(&["status", "--controller", "127.0.0.1:9", "--secret-file", secret, "--tls-cert", junk, "--tls-key", junk]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid --tls-ca"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = lazarus(&["agent", "--controller", "127.0.0.1:9", "--gpus", "1", "--secret-file", secret, "--tls-ca", junk]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid --tls-ca"), "{}", String::from_utf8_lossy(&out.stderr));
}
