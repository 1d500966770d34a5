//! The Kubernetes manifests (`deploy/kubernetes`), checked as far as a machine without a cluster
//! allows: they render (`kubectl kustomize`, where kubectl is installed), hang together (the
//! Service reaches the controller's port, every pod mounts the Secret and the ConfigMap where
//! lazarus.toml says, agents ask for as many GPUs as they bring workers), and the pods' own
//! commands run the job: the controller's and two agents' argument lists, taken from the
//! manifests with the mounts and the pod address mapped onto this machine, train; one agent is
//! SIGKILLed (a lost pod) and started again with the same arguments (the StatefulSet's
//! replacement), and it rejoins the running job; then the controller is SIGKILLed, its agents
//! wait with their workers paused, and the controller started again takes the job back and runs
//! it to the end with every step once.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{dir, log, signal, spawn_lazarus, wait, wait_for_steps};
use serde::Deserialize;
use serde_yaml::Value;

/// The causes of the reconfigurations the log at `path` records.
fn causes_of(path: &Path) -> Vec<String> {
    log(path).1.iter().filter_map(|r| r["cause"].as_str().map(String::from)).collect()
}

fn manifests() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes")
}

/// Every object of the kustomization's resources, by `Kind/name`.
fn objects() -> BTreeMap<String, Value> {
    let kustomization: Value = serde_yaml::from_str(&std::fs::read_to_string(manifests().join("kustomization.yaml")).unwrap()).unwrap();
    let mut all = BTreeMap::new();
    for file in kustomization["resources"].as_sequence().unwrap() {
        let text = std::fs::read_to_string(manifests().join(file.as_str().unwrap())).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v = Value::deserialize(doc).unwrap();
            all.insert(format!("{}/{}", v["kind"].as_str().unwrap(), v["metadata"]["name"].as_str().unwrap()), v);
        }
    }
    all
}

fn as_strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_sequence().map(|s| s.iter().map(|x| x.as_str().unwrap().to_string()).collect()).unwrap_or_default()
}

/// The one container of a workload: its command with arguments, and its mounts (path → volume).
fn container(workload: &Value) -> (Vec<String>, BTreeMap<String, String>, Value) {
    let pod = &workload["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let mut argv = strings(&c["command"]);
    argv.extend(strings(&c["args"]));
    let mounts = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|m| (m["mountPath"].as_str().unwrap().to_string(), m["name"].as_str().unwrap().to_string()))
        .collect();
    (argv, mounts, pod["volumes"].clone())
}

fn volume<'a>(volumes: &'a Value, name: &str) -> &'a Value {
    volumes.as_sequence().unwrap().iter().find(|v| v["name"] == name).unwrap_or_else(|| panic!("volume {name}"))
}

#[test]
fn the_manifests_hang_together_and_render() {
    let all = objects();
    let toml: toml::Table = toml::from_str(&std::fs::read_to_string(manifests().join("lazarus.toml")).unwrap()).unwrap();
    let (ctl, agt) = (toml["controller"].as_table().unwrap(), toml["agent"].as_table().unwrap());
    let deployment = &all["Deployment/lazarus-controller"];
    assert_eq!(deployment["spec"]["replicas"].as_u64(), Some(1), "one controller");
    assert_eq!(deployment["spec"]["strategy"]["type"].as_str(), Some("Recreate"), "never two controllers at once");
    // The Service selects the controller's pods and reaches the port it listens on; the agents
    // name the Service.
    let service = &all["Service/lazarus-controller"];
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    for (k, v) in service["spec"]["selector"].as_mapping().unwrap() {
        assert_eq!(&labels[k], v, "the Service selects the controller's pods");
    }
    let listen_port = ctl["listen"].as_str().unwrap().rsplit(':').next().unwrap().parse::<u64>().unwrap();
    let grpc = service["spec"]["ports"].as_sequence().unwrap().iter().find(|p| p["name"] == "grpc").unwrap();
    let container_ports = &deployment["spec"]["template"]["spec"]["containers"][0]["ports"];
    let target = container_ports.as_sequence().unwrap().iter().find(|p| p["name"] == grpc["targetPort"]).unwrap();
    assert_eq!(target["containerPort"].as_u64(), Some(listen_port));
    assert_eq!(agt["controller"].as_str().unwrap(), format!("lazarus-controller:{}", grpc["port"].as_u64().unwrap()));
    // Both kinds of pod mount the Secret where secret_file is, and lazarus.toml from the ConfigMap.
    let agents = &all["StatefulSet/lazarus-agent"];
    for (workload, table) in [(deployment, ctl), (agents, agt)] {
        let (argv, mounts, volumes) = container(workload);
        let secret_file = table["secret_file"].as_str().unwrap();
        let (dir, file) = secret_file.rsplit_once('/').unwrap();
        let secret = volume(&volumes, &mounts[dir]);
        assert_eq!(secret["secret"]["secretName"].as_str(), Some("lazarus-job"));
        let config_at = &argv[argv.iter().position(|a| a == "--config").unwrap() + 1];
        assert_eq!(volume(&volumes, &mounts[config_at])["configMap"]["name"].as_str(), Some("lazarus-config"));
        assert!(
            mounts.keys().any(|m| toml["checkpoint_dir"].as_str().unwrap().starts_with(m.as_str())),
            "checkpoints on the shared volume"
        );
        assert_eq!(file, "job.secret");
    }
    // Agents ask for the GPUs they bring, and as many agents as the job's workers need.
    let gpus = agt["gpus"].as_integer().unwrap();
    let limits = &agents["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"];
    assert_eq!(limits["nvidia.com/gpu"].as_i64(), Some(gpus));
    assert_eq!(ctl["gpus_per_node"].as_integer(), Some(gpus));
    assert_eq!(agents["spec"]["replicas"].as_i64().unwrap() * gpus, ctl["workers"].as_integer().unwrap());
    assert_eq!(all["PersistentVolumeClaim/lazarus-checkpoints"]["spec"]["accessModes"][0].as_str(), Some("ReadWriteMany"));
    // The pods run as the image's user, and that user can read the Secret's file: the volumes
    // are given its group (fsGroup) and the file is group-readable. Each container says what it
    // needs (requests) and a memory limit; the agents tolerate GPU nodes' taint; the
    // controller has probes on its port.
    let dockerfile = std::fs::read_to_string(manifests().join("../Dockerfile")).unwrap();
    let user = dockerfile.lines().find_map(|l| l.strip_prefix("USER ")).expect("the image's USER").trim();
    let (uid, gid) = user.split_once(':').expect("USER uid:gid");
    for workload in [deployment, agents] {
        let pod = &workload["spec"]["template"]["spec"];
        let sc = &pod["securityContext"];
        assert_eq!(sc["runAsUser"].as_u64().map(|u| u.to_string()).as_deref(), Some(uid), "{sc:?}");
        assert_eq!(sc["fsGroup"].as_u64().map(|g| g.to_string()).as_deref(), Some(gid), "{sc:?}");
        let (_, mounts, volumes) = container(workload);
        let dir = ctl["secret_file"].as_str().unwrap().rsplit_once('/').unwrap().0;
        let mode = volume(&volumes, &mounts[dir])["secret"]["defaultMode"].as_u64().expect("a defaultMode");
        assert!(mode & 0o040 != 0 && mode & 0o007 == 0, "group-readable, not world-readable: {mode:o}");
        let resources = &pod["containers"][0]["resources"];
        assert!(resources["requests"]["cpu"].as_str().is_some() && resources["requests"]["memory"].as_str().is_some(), "{resources:?}");
        assert!(resources["limits"]["memory"].as_str().is_some(), "{resources:?}");
    }
    let tolerations = agents["spec"]["template"]["spec"]["tolerations"].as_sequence().expect("tolerations");
    assert!(tolerations.iter().any(|t| t["key"] == "nvidia.com/gpu" && t["effect"] == "NoSchedule"), "{tolerations:?}");
    let c = &deployment["spec"]["template"]["spec"]["containers"][0];
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(c[probe]["tcpSocket"]["port"].as_str(), Some("grpc"), "{probe}");
    }
    // The image is named once, in the kustomization, where a registry is set.
    let kustomization: Value = serde_yaml::from_str(&std::fs::read_to_string(manifests().join("kustomization.yaml")).unwrap()).unwrap();
    assert_eq!(kustomization["images"][0]["name"].as_str(), Some("lazarus"));
    // The GPU image carries the CUDA libraries the binary links against (the container runtime
    // brings only the driver), and the GPU generation is a build argument.
    for want in ["ARG CUDA_COMPUTE_CAP", "cudart cublas cublasLt curand nvrtc", "LD_LIBRARY_PATH=/usr/local/lib/lazarus-cuda"] {
        assert!(dockerfile.contains(want), "the Dockerfile has {want}");
    }

    // kubectl renders it with a secret in place.
    if Command::new("kubectl").arg("version").arg("--client").output().is_err() {
        eprintln!("kubectl not installed: the render is not checked");
        return;
    }
    let d = dir("kubernetes-render");
    for e in std::fs::read_dir(manifests()).unwrap().flatten() {
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    std::fs::write(d.join("job.secret"), "7f3a9c2e5b8d1f4a6c0e9b2d7a5f3c81\n").unwrap();
    let out = Command::new("kubectl").arg("kustomize").arg(&*d).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rendered = String::from_utf8_lossy(&out.stdout);
    let kinds: Vec<String> = serde_yaml::Deserializer::from_str(&rendered)
        .map(|doc| {
            let v = Value::deserialize(doc).unwrap();
            format!("{}/{}", v["kind"].as_str().unwrap(), v["metadata"]["name"].as_str().unwrap())
        })
        .collect();
    for want in ["ConfigMap/lazarus-config", "Secret/lazarus-job", "Deployment/lazarus-controller", "StatefulSet/lazarus-agent"] {
        assert!(kinds.iter().any(|k| k == want), "{want} in {kinds:?}");
    }
}

/// A workload's argument list with its mounts and names mapped as `map` says (the pod's address:
/// loopback), and `more` flags after it.
fn on_this_machine(workload: &Value, map: &[(String, String)], more: &[&str]) -> Vec<String> {
    let (argv, _, _) = container(workload);
    assert_eq!(argv[0], "lazarus");
    let mut args: Vec<String> = argv[1..]
        .iter()
        .map(|a| {
            let mut a = a.replace("$(POD_IP)", "127.0.0.1");
            for (from, to) in map {
                a = a.replace(from, to);
            }
            a
        })
        .collect();
    args.extend(more.iter().map(|s| s.to_string()));
    args
}

#[test]
fn the_pods_commands_run_the_job_and_a_lost_agent_pod_comes_back_and_joins() {
    let all = objects();
    let d = dir("kubernetes-run");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    // The mounts, as directories here; the Service's name, as the controller's address here.
    let (etc, data) = (d.join("etc"), d.join("data"));
    std::fs::create_dir_all(etc.join("secret")).unwrap();
    std::fs::write(etc.join("secret/job.secret"), "7f3a9c2e5b8d1f4a6c0e9b2d7a5f3c81\n").unwrap();
    let map = vec![
        ("/etc/lazarus".to_string(), etc.to_str().unwrap().to_string()),
        ("/var/lib/lazarus".to_string(), data.to_str().unwrap().to_string()),
        ("lazarus-controller:7070".to_string(), format!("127.0.0.1:{port}")),
        ("0.0.0.0:7070".to_string(), format!("127.0.0.1:{port}")),
        ("0.0.0.0:9464".to_string(), "127.0.0.1:0".to_string()),
    ];
    let mut toml = std::fs::read_to_string(manifests().join("lazarus.toml")).unwrap();
    for (from, to) in &map {
        toml = toml.replace(from, to);
    }
    // The job's shape is the file's but smaller: the tiny model (in the file, as a resumed run
    // must agree with it), 2 agents of 1 worker on CPU.
    let mut file: toml::Table = toml::from_str(&toml).unwrap();
    for (key, value) in [("steps", 300), ("batch_size", 8), ("seq_len", 16), ("checkpoint_every", 50)] {
        file.insert(key.into(), toml::Value::Integer(value));
    }
    let model = file.get_mut("model").and_then(toml::Value::as_table_mut).unwrap();
    for (key, value) in [("d_model", 32), ("n_layers", 2), ("n_heads", 2), ("n_experts", 4), ("d_ff", 32)] {
        model.insert(key.into(), toml::Value::Integer(value));
    }
    std::fs::write(etc.join("lazarus.toml"), toml::to_string(&file).unwrap()).unwrap();
    let path = d.join("log.jsonl");
    let small = vec![
        "--device",
        "cpu",
        "--workers",
        "2",
        "--gpus-per-node",
        "1",
        "--max-workers",
        "2",
        "--join-wait",
        "0.2",
        "--synthetic-bytes",
        "20000",
        "--lease",
        "0.5",
        // Pods share the cluster's network: the workers' connections encrypted.
        "--encrypt-data",
        "--json-log",
        path.to_str().unwrap(),
    ];
    let ctl_args = on_this_machine(&all["Deployment/lazarus-controller"], &map, &small);
    let agent_args = on_this_machine(&all["StatefulSet/lazarus-agent"], &map, &["--gpus", "1"]);
    // Paced (every step 20 ms or more): the job's 300 steps outlast a lost pod's return and the
    // controller's loss, which come after step 40 and step 100, on any machine.
    let start_agent = || spawn_lazarus(&as_strs(&agent_args), &common::paced(20));
    let (mut controller, _) = spawn_lazarus(&as_strs(&ctl_args), &[]);
    let (mut first, first_lines) = start_agent();
    let (mut second, _) = start_agent();
    // An agent pod lost: made again, it rejoins.
    wait_for_steps(&path, 40);
    signal(second.id() as i32, libc::SIGKILL);
    let _ = second.wait();
    // The pod is made again once its loss is seen (a job at its --max-workers has no room for
    // it before: an agent that comes first is refused and exits, and its pod would be made
    // again after a back-off).
    common::hosts::wait_for_records(&path, 1);
    let (mut again, again_lines) = start_agent();
    // Its join is logged before the controller is lost (on a loaded machine the job can pass
    // step 100 first; then the takeover below would take the new agent in instead).
    // (Read while the job writes it: only whole lines.)
    let joined = || {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let whole = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
        whole.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).any(|v| v["cause"] == "join")
    };
    let mut said = Vec::new();
    wait::until("the agent pod made again to join", Duration::from_secs(120), || {
        said.extend(again_lines.try_iter());
        if joined() {
            Ok(())
        } else {
            Err(format!("{} lines logged, no join; the agent said:\n{}", wait::logged(&path), said.join("\n")))
        }
    });
    // The controller pod lost after a checkpoint: its agents keep their workers, paused; the
    // controller pod made again takes the job back (--resume-if-any finds the running job's
    // state in the checkpoint volume) and the job goes on to its end with nothing lost.
    let checkpoint = data.join("checkpoints/latest");
    wait::until("a checkpoint at step 100", Duration::from_secs(120), || {
        let latest = std::fs::read_to_string(&checkpoint).unwrap_or_default();
        if latest.trim() >= "step-00000100" {
            Ok(())
        } else {
            Err(format!("latest {:?}", latest.trim()))
        }
    });
    signal(controller.id() as i32, libc::SIGKILL);
    let _ = controller.wait();
    for (agent, lines) in [(&mut first, &first_lines), (&mut again, &again_lines)] {
        wait::line(lines, "an agent whose controller is lost to wait for the next one", Duration::from_secs(30), &mut Vec::new(), |l| {
            l.contains("wait up to")
        });
        assert!(agent.try_wait().unwrap().is_none(), "an agent whose controller is lost waits for the next one");
    }
    let (mut controller, ctl_lines) = spawn_lazarus(&as_strs(&ctl_args), &[]);
    let text = wait::job_success(&mut controller, &ctl_lines, &path, "the job taken back by the controller pod made again");
    assert!(text.iter().any(|l| l.contains("holds a running job's state: taking it back")), "{}", text.join("\n"));
    for (agent, lines) in [(&mut first, &first_lines), (&mut again, &again_lines)] {
        wait::success(agent, lines, "an agent of the job taken back", Duration::from_secs(30));
    }
    let numbers: Vec<u64> = log(&path).0.iter().map(|(s, _)| *s).collect();
    assert_eq!(numbers, (1..=300).collect::<Vec<_>>(), "every step once");
    let causes = causes_of(&path);
    assert!(causes.iter().any(|c| c == "join"), "the lost agent pod was taken back in: {causes:?}");
    assert!(causes.iter().any(|c| c == "controller") && !causes.iter().any(|c| c == "rollback"), "taken back, not rolled back: {causes:?}");
}
