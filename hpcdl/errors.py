"""The errors hpcdl raises for the user to act on; the CLI prints them without a traceback."""


class HpcdlError(Exception):
    """Base class: the message says what is wrong and how to fix it."""

    # whether a restart may get past it (a full disk freed, a loader worker the OOM killer took): a rank that meets
    # it alone tells the others so, and they stop as after a lost peer, which a supervisor restarts (hpcdl.train.leaving)
    restartable = False


class ConfigError(HpcdlError, ValueError):
    """A value the user gave (flag, field, environment variable) cannot work."""


class LaunchError(HpcdlError):
    """The job could not be set up or started."""


class RankLostError(HpcdlError):
    """A peer rank died or stopped answering during a collective."""


class DataError(HpcdlError):
    """A dataset, shard or manifest is missing, damaged or inconsistent; the message names the file."""


class StorageError(DataError):
    """The filesystem failed a read (a storage server down, a mount lost): the data is not damaged, and reads again
    once the filesystem answers. A rank that meets it in training writes the just-in-time checkpoint first."""


class CheckpointError(HpcdlError):
    """A checkpoint could not be written; the message names the path and says which one is kept."""

    restartable = True


class TrainingDiverged(HpcdlError):
    """The loss became NaN or infinite; the run stopped without writing a checkpoint."""
