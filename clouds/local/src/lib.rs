//! The `local` cloud: real processes on this machine stand in for VMs.
//!
//! A node is an `lbscale-node serve` process on its own loopback address
//! (`127.x.y.z`), started in its own session so that it outlives the process that
//! made it, as a VM outlives the API call that created it. Distributors are
//! `lbscale-node dns` and `lbscale-node nlb` processes that read a JSON file the
//! engine writes atomically and acknowledge each version in a status file.
//!
//! Files live under `<store dir>/local/`: per node its management API's files
//! (token hash, CA certificate, its certificate and key; mode 0600) and log,
//! per distributor its config, status and log.

use lbscale_engine::cloud::{
    Balance, Cloud, CloudError, Distributor, DriverStore, ProvisionRequest, Provisioned,
    Publication, Result,
};
use lbscale_engine::model::{DistributorMode, DistributorSpec};
use lbscale_engine::store::NodeRow;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod process;
use process::{Mark, Started};

/// How long a started process gets to come up (API listening / first status).
const START_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a distributor gets to acknowledge a new configuration.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct LocalSettings {
    /// Loopback prefix node and distributor addresses are taken from, e.g. `127.0.`.
    pub address_prefix: String,
    pub dns_port: u16,
    pub node_api_port: u16,
    /// `lbscale-node`; found next to the running executable or on PATH when unset.
    pub node_binary: Option<PathBuf>,
}

impl Default for LocalSettings {
    fn default() -> Self {
        LocalSettings {
            address_prefix: "127.0.".into(),
            dns_port: 10053,
            node_api_port: 9990,
            node_binary: None,
        }
    }
}

/// Checks `address_prefix`: one to three octets of 127.0.0.0/8, ending with a dot.
pub fn check_address_prefix(prefix: &str) -> std::result::Result<(), String> {
    let parts: Vec<&str> = prefix.strip_suffix('.').unwrap_or("x").split('.').collect();
    let ok = prefix.ends_with('.')
        && (1..=3).contains(&parts.len())
        && parts[0] == "127"
        && parts.iter().all(|p| p.parse::<u8>().is_ok());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "address_prefix must be the start of a 127.0.0.0/8 address ending with a dot, such as \"127.0.\" or \"127.42.\", got {prefix:?}"
        ))
    }
}

/// Every address under the prefix, skipping `.0`, `.1` and `.255` in the last octet.
fn candidates(prefix: &str) -> Box<dyn Iterator<Item = String>> {
    let given = prefix.trim_end_matches('.').split('.').count();
    let p = prefix.to_string();
    match given {
        1 => Box::new((0..=255u16).flat_map(move |b| {
            let p = p.clone();
            (1..=254u16).flat_map(move |c| {
                let p = p.clone();
                (2..=254u16).map(move |d| format!("{p}{b}.{c}.{d}"))
            })
        })),
        2 => Box::new((1..=254u16).flat_map(move |c| {
            let p = p.clone();
            (2..=254u16).map(move |d| format!("{p}{c}.{d}"))
        })),
        _ => Box::new((2..=254u16).map(move |d| format!("{p}{d}"))),
    }
}

/// An address nobody else on the machine is using: no socket of any program (of
/// another store, say) is bound to it, and `port` can be bound on it.
fn address_free(ip: &str, port: u16) -> bool {
    !address_bound(ip) && std::net::TcpListener::bind((ip, port)).is_ok()
}

/// Whether any TCP or UDP socket is bound to `ip` (from /proc/net, where an IPv4
/// address is the little-endian hex of its four bytes).
fn address_bound(ip: &str) -> bool {
    let Ok(addr) = ip.parse::<std::net::Ipv4Addr>() else {
        return false;
    };
    let hex = format!("{:08X}", u32::from_le_bytes(addr.octets()));
    ["/proc/net/tcp", "/proc/net/udp"].iter().any(|table| {
        std::fs::read_to_string(table)
            .map(|text| {
                text.lines()
                    .skip(1)
                    .filter_map(|l| l.split_whitespace().nth(1))
                    .any(|local| local.split(':').next() == Some(hex.as_str()))
            })
            .unwrap_or(false)
    })
}

pub fn find_node_binary(explicit: Option<&Path>) -> std::result::Result<PathBuf, String> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(format!("local.node_binary {} does not exist", p.display()))
        };
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            let p = dir.join("lbscale-node");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("lbscale-node");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    Err("lbscale-node was not found next to the provider nor on PATH; set local { node_binary = \"/path/to/lbscale-node\" }".into())
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct NodeHandle {
    #[serde(flatten)]
    process: Started,
    api_port: u16,
    dir: PathBuf,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct DistributorRuntime {
    #[serde(flatten)]
    process: Started,
    dir: PathBuf,
    /// `dns`: the DNS server's address.
    address: Option<String>,
    dns_port: u16,
    /// `nlb`: the VIP of each AZ.
    vips: BTreeMap<String, String>,
    version: u64,
    /// The highest lease fence a publication was applied under (0: none).
    #[serde(default)]
    fence: i64,
}

pub struct LocalCloud {
    settings: LocalSettings,
    store: DriverStore,
    root: PathBuf,
}

/// The local cloud's drivers with `settings`, to register (see [`lbscale_engine::cloud::Clouds`]).
pub fn drivers(
    settings: LocalSettings,
) -> impl FnOnce(DriverStore) -> std::result::Result<lbscale_engine::cloud::Drivers, String>
       + Send
       + 'static {
    move |store| {
        Ok(lbscale_engine::cloud::Drivers::of(LocalCloud::new(
            settings, store,
        )))
    }
}

impl LocalCloud {
    pub fn new(settings: LocalSettings, store: DriverStore) -> LocalCloud {
        let root = store.dir().join("local");
        LocalCloud {
            settings,
            store,
            root,
        }
    }

    /// Where node `id` keeps its token file and log.
    fn node_dir(&self, id: &str) -> PathBuf {
        self.root.join("nodes").join(id)
    }

    fn binary(&self) -> Result<PathBuf> {
        find_node_binary(self.settings.node_binary.as_deref()).map_err(CloudError::Failed)
    }

    fn reserve(&self, owner: &str, port: u16) -> Result<String> {
        self.store
            .reserve_address(owner, candidates(&self.settings.address_prefix), |a| {
                address_free(a, port)
            })?
            .ok_or_else(|| {
                CloudError::Failed(format!(
                    "no free loopback address left under {}",
                    self.settings.address_prefix
                ))
            })
    }

    fn runtime(&self, id: &str) -> DistributorRuntime {
        self.store.load_runtime(id).unwrap_or_default()
    }

    fn save_runtime(&self, id: &str, rt: &DistributorRuntime) -> Result<()> {
        self.store.save_runtime(id, rt)
    }
}

#[async_trait::async_trait]
impl Cloud for LocalCloud {
    async fn provision(&self, req: &ProvisionRequest) -> Result<Provisioned> {
        let bin = self.binary()?;
        let port = self.settings.node_api_port;
        let ip = self.reserve(&req.node_id, port)?;
        let dir = self.node_dir(&req.node_id);
        std::fs::create_dir_all(&dir).map_err(|e| fail("create the node directory", &dir, e))?;
        // What a cloud's boot configuration gives a node: its API's files.
        let c = &req.credentials;
        let mut api_files = Vec::new();
        for (option, name, content) in [
            ("--token-file", "token", &c.token_file),
            ("--tls-ca", "ca.pem", &c.ca_pem),
            ("--tls-cert", "node.pem", &c.cert_pem),
            ("--tls-key", "node-key.pem", &c.key_pem),
        ] {
            let path = dir.join(name);
            write_private(&path, content.as_bytes())
                .map_err(|e| fail("write the node API's files", &path, e))?;
            api_files.extend([option.to_string(), path.display().to_string()]);
        }
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--node-id".into(),
            req.node_id.clone(),
            "--listen-ip".into(),
            ip.clone(),
            "--api-port".into(),
            port.to_string(),
            "--memory-limit-mb".into(),
            req.node.memory_limit_mb.to_string(),
            // Many nodes share this machine: each reports its own process.
            "--stats".into(),
            "process".into(),
        ];
        args.extend(api_files);
        let mark = Mark::node(&req.node_id);
        let process = process::spawn_detached(&bin, &args, &dir.join("node.log"), &mark)?;
        // The process exists now: wait for its API socket (a VM that has booted).
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if std::net::TcpStream::connect_timeout(
                &format!("{ip}:{port}").parse().expect("ip:port"),
                Duration::from_millis(200),
            )
            .is_ok()
            {
                break;
            }
            if !process::is_ours(&process, &mark) {
                let tail = log_tail(&dir.join("node.log"));
                return Err(CloudError::Failed(format!(
                    "node {} exited while starting: {tail}",
                    req.node_id
                )));
            }
            if Instant::now() > deadline {
                // The start's failure is what to report; a stop that fails too
                // leaves the process to deprovisioning, which finds it by its mark.
                let _ = process::stop(&process, &mark).await;
                return Err(CloudError::Failed(format!(
                    "node {} did not open its management API on {ip}:{port} within {}s",
                    req.node_id,
                    START_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let handle = NodeHandle {
            process,
            api_port: port,
            dir,
        };
        Ok(Provisioned {
            private_ip: ip.clone(),
            public_ip: Some(ip),
            api_port: port,
            handle: serde_json::to_value(handle).expect("handle serialises"),
        })
    }

    async fn deprovision(&self, node: &NodeRow) -> Result<()> {
        let h: NodeHandle = serde_json::from_value(node.handle.clone()).unwrap_or_default();
        let mark = Mark::node(&node.id);
        if h.process.pid != 0 {
            process::stop(&h.process, &mark).await?;
        } else {
            // A crash between starting the process and recording its pid: find
            // it by its exact `--node-id`, so that it is not orphaned.
            let exe = self
                .binary()
                .ok()
                .and_then(|b| std::fs::canonicalize(b).ok())
                .unwrap_or_default();
            // Every one is stopped before a failure is told.
            let mut first_failure = Ok(());
            for p in process::find(&mark, &exe) {
                let stopped = process::stop(&p, &mark).await;
                first_failure = first_failure.and(stopped);
            }
            first_failure?;
        }
        // Without a stored handle, the directory is where provision makes it:
        // it holds the node's key, which must not outlive the node.
        let dir = if h.dir.as_os_str().is_empty() {
            self.node_dir(&node.id)
        } else {
            h.dir
        };
        if dir.starts_with(&self.root) && dir.exists() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        self.store.release_addresses(&node.id)
    }

    async fn is_alive(&self, node: &NodeRow) -> Result<bool> {
        let h: NodeHandle = serde_json::from_value(node.handle.clone()).unwrap_or_default();
        Ok(process::is_ours(&h.process, &Mark::node(&node.id)))
    }

    fn api_port(&self, node: &NodeRow) -> u16 {
        let h: NodeHandle = serde_json::from_value(node.handle.clone()).unwrap_or_default();
        if h.api_port == 0 {
            self.settings.node_api_port
        } else {
            h.api_port
        }
    }
}

#[async_trait::async_trait]
impl Distributor for LocalCloud {
    async fn ensure(&self, id: &str, spec: &DistributorSpec) -> Result<()> {
        let mut rt = self.runtime(id);
        if process::is_ours(&rt.process, &Mark::distributor(&rt.dir)) {
            return Ok(());
        }
        let bin = self.binary()?;
        rt.dir = self.root.join("distributors").join(id);
        std::fs::create_dir_all(&rt.dir)
            .map_err(|e| fail("create the distributor directory", &rt.dir, e))?;
        let config = rt.dir.join("config.json");
        let status = rt.dir.join("status.json");
        if !config.exists() {
            write_atomic(&config, &empty_config(spec)).map_err(|e| fail("write", &config, e))?;
        }
        let _ = std::fs::remove_file(&status);
        let mut args: Vec<String> = vec![spec.mode.as_str().to_string()];
        if spec.mode == DistributorMode::Dns {
            let port = self.settings.dns_port;
            let addr = match rt.address.clone() {
                Some(a) => a,
                None => self.reserve(id, port)?,
            };
            rt.address = Some(addr.clone());
            rt.dns_port = port;
            args.extend(["--listen".into(), format!("{addr}:{port}")]);
        }
        args.extend([
            "--config".into(),
            config.display().to_string(),
            // The status file is the distributor's own: it marks the process as ours.
            "--status".into(),
            status.display().to_string(),
        ]);
        let mark = Mark::distributor(&rt.dir);
        rt.process = process::spawn_detached(&bin, &args, &rt.dir.join("distributor.log"), &mark)?;
        self.save_runtime(id, &rt)?;
        wait_status(
            &status,
            0,
            &rt,
            id,
            START_TIMEOUT,
            &rt.dir.join("distributor.log"),
        )
        .await
    }

    async fn publish(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
    ) -> Result<()> {
        self.publish_under(id, spec, publication, None).await
    }

    async fn publish_fenced(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
        fence: i64,
    ) -> Result<()> {
        self.publish_under(id, spec, publication, Some(fence)).await
    }

    async fn remove(&self, id: &str) -> Result<()> {
        let rt = self.runtime(id);
        process::stop(&rt.process, &Mark::distributor(&rt.dir)).await?;
        if rt.dir.starts_with(&self.root) && rt.dir.exists() {
            let _ = std::fs::remove_dir_all(&rt.dir);
        }
        self.store.release_addresses(id)
    }

    fn addresses(&self, id: &str, spec: &DistributorSpec) -> BTreeMap<String, String> {
        let rt = self.runtime(id);
        if spec.mode == DistributorMode::Dns {
            rt.address
                .map(|a| ("dns".to_string(), format!("{a}:{}", rt.dns_port)))
                .into_iter()
                .collect()
        } else {
            rt.vips
        }
    }
}

fn empty_config(spec: &DistributorSpec) -> Vec<u8> {
    if spec.mode == DistributorMode::Dns {
        br#"{"version":0,"zones":[]}"#.to_vec()
    } else {
        br#"{"version":0,"listeners":[]}"#.to_vec()
    }
}

fn fail(what: &str, path: &Path, e: std::io::Error) -> CloudError {
    CloudError::Failed(format!("could not {what} {}: {e}", path.display()))
}

/// Waits until the distributor acknowledges `version` in its status file.
async fn wait_status(
    status: &Path,
    version: u64,
    rt: &DistributorRuntime,
    id: &str,
    timeout: Duration,
    log: &Path,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(text) = std::fs::read_to_string(status) {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
                if v["version"].as_u64().unwrap_or(0) >= version {
                    return Ok(());
                }
            }
        }
        if !process::is_ours(&rt.process, &Mark::distributor(&rt.dir)) {
            return Err(CloudError::Failed(format!(
                "distributor {id} exited before applying configuration version {version}: {}",
                log_tail(log)
            )));
        }
        if Instant::now() > deadline {
            return Err(CloudError::Failed(format!(
                "distributor {id} did not apply configuration version {version} within {}s",
                timeout.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(data)
}

/// Writes `path` whole or not at all (a temporary file renamed over it). The
/// temporary name is unique to this process and call, so that two writers (the
/// provider and the daemon) never rename each other's file away.
fn write_atomic(path: &Path, data: &[u8]) -> std::io::Result<()> {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp.{}.{n}", std::process::id()));
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(3).collect();
    if lines.is_empty() {
        format!("(nothing in {})", log.display())
    } else {
        lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }
}

impl LocalCloud {
    /// A publication, refused when `fence` is lower than the highest one the
    /// distributor applied (a holder that lost the distributor's lease).
    async fn publish_under(
        &self,
        id: &str,
        spec: &DistributorSpec,
        publication: &Publication,
        fence: Option<i64>,
    ) -> Result<()> {
        // The engine publishes to a distributor one process at a time (its
        // lease), so this read-modify-write of the config version is safe.
        self.ensure(id, spec).await?;
        let mut rt = self.runtime(id);
        if let Some(f) = fence {
            if f < rt.fence {
                return Err(CloudError::Failed(format!(
                    "publication to distributor {id} refused: it was made under lease fence {f}, and one under fence {} was applied already (the lease was taken over)",
                    rt.fence
                )));
            }
            rt.fence = f;
        }
        rt.version += 1;
        let config = if spec.mode == DistributorMode::Dns {
            let ttl = spec.ttl.get().as_secs();
            let addresses: Vec<&String> = publication.endpoints.values().flatten().collect();
            serde_json::json!({
                "version": rt.version,
                "zones": [{"domain": spec.domain.clone().unwrap_or_default(), "ttl_secs": ttl, "addresses": addresses}],
            })
        } else {
            let mut listeners = Vec::new();
            for (az, ports) in &publication.ports {
                if ports.is_empty() {
                    continue;
                }
                let vip = match rt.vips.get(az) {
                    Some(v) => v.clone(),
                    None => {
                        let v = self.reserve(id, ports[0])?;
                        rt.vips.insert(az.clone(), v.clone());
                        v
                    }
                };
                let nodes = publication.endpoints.get(az).cloned().unwrap_or_default();
                for port in ports {
                    let placed = publication.port_targets.get(az).and_then(|p| p.get(port));
                    let (addresses, balance) = match placed {
                        Some(t) => (&t.addresses, t.balance),
                        None => (&nodes, Balance::RoundRobin),
                    };
                    let targets: Vec<String> =
                        addresses.iter().map(|n| format!("{n}:{port}")).collect();
                    let mut listener =
                        serde_json::json!({"vip": vip, "port": port, "targets": targets});
                    listener["balance"] = match balance {
                        Balance::RoundRobin => "round_robin",
                        Balance::First => "first",
                        Balance::FlowHash => "flow_hash",
                    }
                    .into();
                    listeners.push(listener);
                }
            }
            serde_json::json!({"version": rt.version, "listeners": listeners})
        };
        let path = rt.dir.join("config.json");
        write_atomic(&path, config.to_string().as_bytes()).map_err(|e| fail("write", &path, e))?;
        self.save_runtime(id, &rt)?;
        wait_status(
            &rt.dir.join("status.json"),
            rt.version,
            &rt,
            id,
            PUBLISH_TIMEOUT,
            &rt.dir.join("distributor.log"),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_prefix_rules() {
        assert!(check_address_prefix("127.0.").is_ok());
        assert!(check_address_prefix("127.42.7.").is_ok());
        assert!(check_address_prefix("127.").is_ok());
        for bad in ["10.0.", "127.0", "127.0.0.0.", "127.300.", ""] {
            assert!(check_address_prefix(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_bound_address_is_seen_as_taken() {
        let l = std::net::UdpSocket::bind("127.62.9.9:0").unwrap();
        assert!(address_bound("127.62.9.9"));
        assert!(!address_free("127.62.9.9", 9990));
        drop(l);
        assert!(!address_bound("127.62.9.9"));
        assert!(address_free("127.62.9.9", 9990));
    }

    #[test]
    fn candidates_stay_under_the_prefix() {
        let v: Vec<String> = candidates("127.9.").take(300).collect();
        assert_eq!(v[0], "127.9.1.2");
        assert!(v
            .iter()
            .all(|a| a.starts_with("127.9.") && a.split('.').count() == 4));
        assert_eq!(candidates("127.9.3.").count(), 253);
    }
}
