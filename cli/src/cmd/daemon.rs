//! `lbscale daemon --state URL [--listen 127.0.0.1:9464] [--address-prefix P]
//! [--node-binary PATH] [--dns-port N] [--node-api-port N] [--log-format text|json]`:
//! the sidecar that scales every group of the store between applies (see the
//! `lbscale-daemon` crate). Runs until SIGTERM or SIGINT, then exits 0 after the
//! evaluations in flight.

use std::net::SocketAddr;
use std::path::PathBuf;

use lbscale_cloud_local::check_address_prefix;
use lbscale_daemon::DaemonConfig;
use lbscale_engine::store::{state_url_from_env, STATE_URL_ENV};

use crate::output::CliError;

const FLAGS: &str = "--state, --listen, --address-prefix, --node-binary, --dns-port, --node-api-port, --log-format, --shutdown-grace, --help";

/// `lbscale daemon --help`. docs/daemon.md documents the same flags and
/// variables (cli/tests/daemon_reference.rs compares the two): an entry starts
/// two spaces in, its continuation lines further.
const HELP: &str = "usage: lbscale daemon [--state URL] [--listen IP:PORT] [flags]

Scales every autoscale group of the store between Terraform applies, and serves
/healthz, /metrics, /v1/groups and /v1/events. Runs until SIGTERM or SIGINT,
then waits for the evaluations in flight (--shutdown-grace) and exits 0.
Exit status 2: a bad flag or store URL; 1: the store or the listener cannot be
opened. Reference: docs/daemon.md.

flags (--flag VALUE or --flag=VALUE):
  --state URL                the store: sqlite://PATH (relative to the current
                             directory) or postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE[?PARAMS];
                             default: LBSCALE_STATE (one of the two is required)
  --listen IP:PORT           address of the HTTP API; default 127.0.0.1:9464
  --address-prefix PREFIX    local cloud: loopback prefix of node addresses, as the
                             provider's local.address_prefix; default 127.0.
  --node-binary PATH         local cloud: the lbscale-node binary; default: the one
                             next to lbscale, else on PATH
  --dns-port PORT            local cloud: port of the dns distributors' servers, as
                             the provider's local.dns_port; default 10053
  --node-api-port PORT       local cloud: port of the nodes' management API, as the
                             provider's local.node_api_port; default 9990
  --log-format text|json     log lines on standard error; default text
  --shutdown-grace DURATION  how long a stop waits for evaluations and workflows in
                             flight before abandoning them; default 60s
  --help, -h                 print this text and exit 0

environment:
  LBSCALE_STATE              the store's URL when --state is not given (keeps a
                             PostgreSQL password off the command line)
  LBSCALE_LOG                log filter, such as info or lbscale_daemon=debug,warn;
                             default: RUST_LOG, else info
  RUST_LOG                   log filter when LBSCALE_LOG is unset
  MIMALLOC_PURGE_DELAY       ms the allocator keeps freed memory; unset, 0
  PATH                       where lbscale-node is looked for (local cloud)
  AWS_REGION                 aws cloud: the region (else AWS_DEFAULT_REGION)
  AWS_DEFAULT_REGION         aws cloud: the region when AWS_REGION is unset
  AWS_ACCESS_KEY_ID          aws cloud: access key, first in the credential chain
  AWS_SECRET_ACCESS_KEY      aws cloud: secret key
  AWS_SESSION_TOKEN          aws cloud: session token with the keys above
  AWS_PROFILE                aws cloud: the profile of the shared config and
                             credentials files; default default
  AWS_WEB_IDENTITY_TOKEN_FILE  aws cloud: a web identity token (with AWS_ROLE_ARN)
  AWS_ROLE_ARN               aws cloud: the role a web identity token assumes
  AWS_ROLE_SESSION_NAME      aws cloud: that role's session name
  AWS_CONTAINER_CREDENTIALS_RELATIVE_URI  aws cloud: container credentials (ECS)
  AWS_CONTAINER_CREDENTIALS_FULL_URI      aws cloud: container credentials (EKS, other)
  AWS_CONTAINER_AUTHORIZATION_TOKEN(_FILE)  aws cloud: their authorization token
  AWS_EC2_METADATA_SERVICE_ENDPOINT  aws cloud: the instance metadata service (IMDSv2)
  AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE  aws cloud: IPv4 or IPv6 for it
  AWS_METADATA_SERVICE_TIMEOUT  aws cloud: seconds per metadata request; default 1
  AWS_EC2_METADATA_DISABLED  aws cloud: true skips the instance role
  LBSCALE_AWS_ROLE_ARN       aws cloud: a role assumed over the credentials found
  LBSCALE_AWS_EXTERNAL_ID    aws cloud: that role's external ID
  LBSCALE_AWS_ROLE_SESSION_NAME  aws cloud: that role's session name
  AWS_ENDPOINT_URL           aws cloud: one endpoint for every AWS API
  AWS_CA_BUNDLE              aws cloud: PEM file of the CAs to trust instead of the system's
  LBSCALE_AWS_IMAGE_ID       aws cloud: the image nodes start from
  LBSCALE_AWS_INSTANCE_TYPE  aws cloud: the nodes' instance type; default c5.large
  GOOGLE_CLOUD_PROJECT       gcp cloud: the project (else the next one, else the
                             service-account key's project_id)
  CLOUDSDK_CORE_PROJECT      gcp cloud: the project when GOOGLE_CLOUD_PROJECT is unset
  CLOUDSDK_COMPUTE_REGION    gcp cloud: a check that every zone is in this region
  GOOGLE_APPLICATION_CREDENTIALS  gcp cloud: a service-account key file, first in
                             the chain (then gcloud's application-default file
                             under CLOUDSDK_CONFIG or ~/.config/gcloud, then the
                             instance's metadata server)
  GCE_METADATA_HOST          gcp cloud: the metadata server; default
                             metadata.google.internal
  LBSCALE_GCP_ENDPOINT       gcp cloud: one endpoint for Compute Engine and Cloud DNS
  LBSCALE_GCP_CA_BUNDLE      gcp cloud: PEM file of the CAs to trust instead of the system's
  ARM_SUBSCRIPTION_ID        azure cloud: the subscription (else AZURE_SUBSCRIPTION_ID)
  AZURE_SUBSCRIPTION_ID      azure cloud: the subscription when ARM_SUBSCRIPTION_ID is unset
  LBSCALE_AZURE_RESOURCE_GROUP  azure cloud: the resource group of what lbscale makes
  LBSCALE_AZURE_LOCATION     azure cloud: the region (location) of VMs and load balancers
  ARM_CLIENT_SECRET          azure cloud: a service principal's secret, first in the
                             credential chain (with ARM_TENANT_ID and ARM_CLIENT_ID)
  ARM_TENANT_ID              azure cloud: the tenant of that secret or identity
  ARM_CLIENT_ID              azure cloud: the client id of that secret or identity
  AZURE_CLIENT_SECRET        azure cloud: a secret when ARM_CLIENT_SECRET is unset
                             (with AZURE_TENANT_ID and AZURE_CLIENT_ID)
  AZURE_TENANT_ID            azure cloud: the tenant when the ARM_ one is unset
  AZURE_CLIENT_ID            azure cloud: the client id when the ARM_ one is unset
  AZURE_FEDERATED_TOKEN_FILE  azure cloud: workload identity's token file, after a secret
  ARM_OIDC_TOKEN_FILE_PATH   azure cloud: that file when AZURE_FEDERATED_TOKEN_FILE is unset
  ARM_USE_MSI                azure cloud: true takes the managed identity, skipping the rest
  AZURE_AUTHORITY_HOST       azure cloud: the login endpoint; default
                             https://login.microsoftonline.com
  AZURE_POD_IDENTITY_AUTHORITY_HOST  azure cloud: the instance metadata endpoint
                             (managed identity, last in the chain); default
                             http://169.254.169.254
  LBSCALE_AZURE_ENDPOINT     azure cloud: Azure Resource Manager's URL; default
                             https://management.azure.com
  LBSCALE_AZURE_CA_BUNDLE    azure cloud: PEM file of the CAs to trust instead of the system's
  LBSCALE_AZURE_IMAGE        azure cloud: the nodes' image when a group's node.image is unset
  LBSCALE_AZURE_VM_SIZE      azure cloud: the nodes' VM size when node.size is unset;
                             default Standard_D2s_v5
  LBSCALE_EVENTS_MAX_PER_GROUP  events kept per group; default 1000
  LBSCALE_EVENTS_MAX_AGE     how long an event is kept; default 720h
";

/// Splits `--flag value` / `--flag=value` pairs.
pub fn flag_pairs(args: &[String], known: &str) -> Result<Vec<(String, String)>, CliError> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let (flag, inline) = match args[i].split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (args[i].clone(), None),
        };
        if !flag.starts_with("--") {
            return Err(CliError::Usage(format!(
                "arguments: must be flags ({known}), got {flag:?}"
            )));
        }
        let value = match inline {
            Some(v) => v,
            None => {
                i += 1;
                args.get(i).cloned().ok_or_else(|| {
                    CliError::Usage(format!("{flag}: must be followed by a value, got nothing"))
                })?
            }
        };
        out.push((flag, value));
        i += 1;
    }
    Ok(out)
}

pub fn check_state_url(url: &str) -> Result<(), CliError> {
    check_state_url_from("--state", url)
}

/// `from` names where the URL came from; a value from the environment is not
/// echoed (it may hold a password).
fn check_state_url_from(from: &str, url: &str) -> Result<(), CliError> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok(());
    }
    match url.strip_prefix("sqlite://") {
        Some(rest) if !rest.is_empty() => Ok(()),
        _ => {
            let got = if from == "--state" {
                format!("{url:?}")
            } else {
                let scheme = url.split_once("://").map_or("no scheme", |(s, _)| s);
                format!("a value with {scheme:?} (not shown)")
            };
            Err(CliError::Usage(format!(
                "{from}: must be sqlite://PATH (relative to the current directory) or postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE, got {got}"
            )))
        }
    }
}

/// The store's URL: `--state` if given (already checked), else the environment's
/// `LBSCALE_STATE`.
pub fn state_url(given: Option<String>) -> Result<String, CliError> {
    if let Some(url) = given {
        return Ok(url);
    }
    let url = state_url_from_env().ok_or_else(|| {
        CliError::Usage(format!(
            "--state: must be given (sqlite://PATH or postgres://...), or {STATE_URL_ENV} set, got neither"
        ))
    })?;
    check_state_url_from(STATE_URL_ENV, &url)?;
    Ok(url)
}

fn port(flag: &str, v: &str) -> Result<u16, CliError> {
    v.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
        CliError::Usage(format!("{flag}: must be a port from 1 to 65535, got {v:?}"))
    })
}

/// Runs the command.
pub fn run(args: &[String]) -> Result<(), CliError> {
    let mut state = None;
    let mut listen: SocketAddr = "127.0.0.1:9464".parse().expect("default listen address");
    let mut local = lbscale_cloud_local::LocalSettings::default();
    let mut json_logs = false;
    let mut grace = None;
    if args.iter().any(|a| a == "--help" || a == "-h") {
        print!("{HELP}");
        return Ok(());
    }
    for (flag, value) in flag_pairs(args, FLAGS)? {
        match flag.as_str() {
            "--state" => {
                check_state_url(&value)?;
                state = Some(value);
            }
            "--listen" => {
                listen = value.parse().map_err(|_| {
                    CliError::Usage(format!(
                        "--listen: must be IP:PORT such as 127.0.0.1:9464, got {value:?}"
                    ))
                })?;
            }
            "--address-prefix" => {
                check_address_prefix(&value)
                    .map_err(|e| CliError::Usage(format!("--address-prefix: {e}")))?;
                local.address_prefix = value;
            }
            "--node-binary" => local.node_binary = Some(PathBuf::from(value)),
            "--dns-port" => local.dns_port = port("--dns-port", &value)?,
            "--node-api-port" => local.node_api_port = port("--node-api-port", &value)?,
            "--log-format" => {
                json_logs = match value.as_str() {
                    "text" => false,
                    "json" => true,
                    _ => {
                        return Err(CliError::Usage(format!(
                            "--log-format: must be one of text, json, got {value:?}"
                        )))
                    }
                }
            }
            "--shutdown-grace" => {
                grace = Some(lbscale_core::duration::parse_duration(&value).map_err(|_| {
                    CliError::Usage(format!(
                        "--shutdown-grace: must be a duration such as 60s, got {value:?}"
                    ))
                })?);
            }
            other => {
                return Err(CliError::Usage(format!(
                    "{other}: must be one of {FLAGS}, got an unknown argument"
                )))
            }
        }
    }
    let state = state_url(state)?;
    init_logs(json_logs);
    let cwd =
        std::env::current_dir().map_err(|e| CliError::Output(format!("current directory: {e}")))?;
    let mut cfg = DaemonConfig::new(&state, cwd, listen);
    cfg.local = local;
    if let Some(g) = grace {
        cfg.shutdown_grace = g;
    }
    lbscale_daemon::malloc::tune();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::Output(format!("cannot start the runtime: {e}")))?;
    rt.block_on(async move { lbscale_daemon::run(cfg, shutdown_signal()).await })
        .map_err(|e| CliError::Output(e.to_string()))
}

fn init_logs(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LBSCALE_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Resolves at the first SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).ok();
    let mut int = signal(SignalKind::interrupt()).ok();
    let name = tokio::select! {
        _ = async { match term.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => "SIGTERM",
        _ = async { match int.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => "SIGINT",
    };
    tracing::info!(signal = name, "stopping");
}
