//! One module per subcommand; each exposes `run(args) -> Result<(), CliError>`.

pub mod seplan;
pub mod simulate;
pub mod slowstart;
