"""``sparkdl submit``'s command line: spark-submit's own options (passed on, a few of them read),
sparkdl submit's, and the job's arguments after ``--``."""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Tuple

from sparkdl.cli._common import UsageError
from sparkdl.cli.jobs import JOBS

#: spark-submit's options that take a value (its SparkSubmitOptionParser), passed through as given
#: unless sparkdl submit reads them.
SPARK_SUBMIT_VALUES = frozenset(
    "--archives --conf -c --deploy-mode --driver-class-path --driver-cores --driver-java-options "
    "--driver-library-path --driver-memory --executor-cores --executor-memory --files --jars --keytab --master "
    "--name --num-executors --packages --exclude-packages --principal --properties-file "
    "--extra-properties-file --proxy-user --py-files --queue --repositories --total-executor-cores".split()
)
SPARK_SUBMIT_SWITCHES = frozenset(["--supervise", "--verbose", "-v", "--load-spark-defaults"])
#: spark-submit options that make no sense here, and why.
REFUSED = {
    "--class": "sparkdl submit chooses the application",
    "--kill": "use spark-submit --kill",
    "--status": "use spark-submit --status",
    "--version": "use spark-submit --version",
    "--usage-error": "use spark-submit",
    "--remote": "the jobs run on a classic Spark driver",
}
USAGE = """usage: sparkdl submit {train,predict} [spark-submit options] [sparkdl submit options] -- [job arguments]

Runs spark-submit on the job that ships with sparkdl (sparkdl train / sparkdl predict on the Spark
driver); the job's own options go after --: sparkdl submit train -- --help lists them.

spark-submit options: as spark-submit takes them (--master, --deploy-mode client|cluster, --conf KEY=VALUE,
  --py-files, --archives, --files, --jars, --name, --driver-memory, --executor-memory, ...), passed on.
sparkdl submit options:
  --no-ship-sparkdl   do not ship a zip of sparkdl with --py-files (the executors have sparkdl installed,
                      or --archives ships a packed virtualenv that has it)
  --stage-dir DIR     where the files it ships are written (a fresh folder in it, removed at the end;
                      default: a temporary folder); required with --deploy-mode cluster on a spark://
                      master: the worker that runs the driver reads them there, so every host must mount
                      DIR at the same path
  --dry-run           print the spark-submit command and what it would ship; run nothing

Example:
  sparkdl submit train --master spark://host:7077 --conf spark.executor.instances=2 -- \\
      --data /shared/digits --model models:make_model --features features --label label \\
      --num-workers 2 --epochs 3 --output /shared/runs/digits"""


@dataclasses.dataclass
class SubmitOptions:
    """``sparkdl submit``'s command line, parsed."""

    job: str
    job_args: List[str]
    master: Optional[str] = None
    deploy_mode: Optional[str] = None
    name: Optional[str] = None
    conf: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    py_files: List[str] = dataclasses.field(default_factory=list)
    files: List[str] = dataclasses.field(default_factory=list)
    #: Other spark-submit options, in order, with their values.
    passthrough: List[str] = dataclasses.field(default_factory=list)
    ship_sparkdl: bool = True
    stage_dir: Optional[str] = None
    dry_run: bool = False

    def setting(self, key: str) -> Optional[str]:
        """The last ``--conf key=...`` given, if any."""
        values = [value for name, value in self.conf if name == key]
        return values[-1] if values else None

    @property
    def effective_master(self) -> Optional[str]:
        return self.master or self.setting("spark.master") or os.environ.get("MASTER")

    @property
    def cluster_mode(self) -> bool:
        return (self.deploy_mode or self.setting("spark.submit.deployMode") or "client") == "cluster"

    @property
    def standalone_cluster(self) -> bool:
        """Cluster deploy mode on a standalone master: the PythonRunner route."""
        return self.cluster_mode and (self.effective_master or "").startswith("spark://")


def parse_submit_args(argv: List[str]) -> SubmitOptions:
    """``sparkdl submit``'s arguments; a :class:`UsageError` names what is wrong."""
    if not argv or argv[0] not in JOBS:
        given = f"{argv[0]!r}" if argv else "nothing"
        raise UsageError(f"sparkdl submit: the first argument names the job, train or predict (got {given})")
    ours = argv[1:]
    job_args: List[str] = []
    if "--" in ours:
        at = ours.index("--")
        ours, job_args = ours[:at], ours[at + 1 :]
    options = SubmitOptions(job=argv[0], job_args=job_args)
    tokens = iter(ours)
    for token in tokens:
        option, given_inline, inline = token.partition("=")
        if token == "--no-ship-sparkdl":
            options.ship_sparkdl = False
            continue
        if token == "--dry-run":
            options.dry_run = True
            continue
        if option in SPARK_SUBMIT_SWITCHES and not given_inline:
            options.passthrough.append(option)
            continue
        if option in REFUSED:
            raise UsageError(f"sparkdl submit: {option} is not taken here: {REFUSED[option]}")
        if option not in SPARK_SUBMIT_VALUES and option != "--stage-dir":
            raise UsageError(
                f"sparkdl submit: {token!r} is not a spark-submit option nor one of sparkdl submit's; the job's "
                f"arguments go after --, e.g. sparkdl submit {options.job} --master URL -- --data URL ..."
            )
        value = inline if given_inline else next(tokens, None)
        if value is None:
            raise UsageError(f"sparkdl submit: {option} needs a value")
        _take(options, option, value)
    return options


def _take(options: SubmitOptions, option: str, value: str) -> None:
    """Records one ``option value`` pair of the command line."""
    if option in ("--conf", "-c"):
        key, has_value, setting = value.partition("=")
        if not key or not has_value:
            raise UsageError(f"sparkdl submit: --conf {value!r}: spark-submit's --conf takes KEY=VALUE")
        options.conf.append((key, setting))
    elif option in ("--py-files", "--files"):
        getattr(options, option[2:].replace("-", "_")).extend(item for item in value.split(",") if item)
    elif option == "--deploy-mode":
        if value not in ("client", "cluster"):
            raise UsageError(f"sparkdl submit: --deploy-mode {value!r}: client or cluster")
        options.deploy_mode = value
    elif option in ("--master", "--name", "--stage-dir"):
        setattr(options, option[2:].replace("-", "_"), value)
    else:
        options.passthrough += [option, value]


def asks_for_help(argv: List[str]) -> bool:
    """-h/--help among sparkdl submit's own arguments (after --, it is the job's)."""
    own = argv[: argv.index("--")] if "--" in argv else argv
    return any(argument in ("-h", "--help") for argument in own)
