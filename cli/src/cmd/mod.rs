//! One module per subcommand; each exposes `run(args) -> Result<(), CliError>`.

pub mod chart;
pub mod daemon;
pub mod events;
pub mod load;
pub mod seplan;
pub mod simulate;
pub mod slowstart;
pub mod status;
