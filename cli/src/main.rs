//! `lbscale`: the command-line face of the engine.
//!
//! Today it carries the what-if tools of docs/cli.md (`simulate`, `slowstart`,
//! `se-plan`); the daemon, `status` and `events` join later as further arms of the
//! `match` in [`run`], each with its own module under `cmd/`. Every command shares the
//! same contract: JSON in (a file or `-` for standard input), JSON out on standard
//! output, and on invalid input exit status 2 with one line on standard error,
//! `error: <field path>: <what is allowed>, got <value>`.

mod cmd;
mod output;

use std::process::ExitCode;

use output::CliError;

const USAGE: &str = "usage: lbscale <command> [arguments]

commands:
  simulate FILE|-        replay a metric trace against a scaling policy
  slowstart FILE|-       request rates of a vserver's services under slow start
  se-plan --nodes N [--forwarding-cost X] [--mode native|bgp|native_and_bgp]
                         capacity and shares of a vserver scaled out over N nodes
  daemon --state URL [--listen 127.0.0.1:9464] [--address-prefix P] [--node-binary PATH]
         [--log-format text|json]
                         scale every group of the store between applies
  status --state URL     every group with its nodes per AZ
  events --state URL [--group NAME] [--limit N]
                         recorded decisions and workflow steps
                         (--state may be left out when LBSCALE_STATE holds the URL:
                         a PostgreSQL password then stays off the command line;
                         groups on aws take AWS_REGION, AWS_ACCESS_KEY_ID,
                         AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL,
                         AWS_CA_BUNDLE, LBSCALE_AWS_IMAGE_ID and
                         LBSCALE_AWS_INSTANCE_TYPE from the environment)
  load --url http://HOST[:PORT]/PATH [--dns IP:PORT | --resolve HOST:PORT:IP]...
       [--rate N] [--connections N] [--duration 60s] [--report 2s] [--csv FILE]
                         drive HTTP traffic, printing req/s and Mbps as it goes
  chart --samples FILE.csv --out FILE.svg [--events FILE.json] [--max-mbps X]
        [--min-mbps Y] [--title TEXT]
                         draw nodes and load over time as an SVG
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", e.message());
            ExitCode::from(e.exit_code())
        }
    }
}

fn run(args: &[String]) -> Result<(), CliError> {
    let (command, rest) = match args.split_first() {
        Some((c, rest)) => (c.as_str(), rest),
        None => {
            return Err(CliError::Usage(
                "command: must be one of simulate, slowstart, se-plan, daemon, status, events, got nothing".into(),
            ))
        }
    };
    match command {
        "simulate" => cmd::simulate::run(rest),
        "slowstart" => cmd::slowstart::run(rest),
        "se-plan" => cmd::seplan::run(rest),
        "daemon" => cmd::daemon::run(rest),
        "status" => cmd::status::run(rest),
        "events" => cmd::events::run(rest),
        "load" => cmd::load::run(rest),
        "chart" => cmd::chart::run(rest),
        "help" | "-h" | "--help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => Err(CliError::Usage(format!(
            "command: must be one of simulate, slowstart, se-plan, daemon, status, events, got {other:?}"
        ))),
    }
}
