"""Record keys, config keys and metric names: the words sites and server agree on.

Flower's standard convention (``arrays`` + ``config`` in; ``arrays`` + ``metrics`` with
``num-examples`` out) is kept so that a user's existing Flower ClientApp joins an
flplatform server unchanged. Our own keys extend it and are all defined here.
"""

from __future__ import annotations

# ---- RecordDict keys (Flower's standard names)
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
SITE_INFO = "site-info"
# the run config a site reads its data, model and app keys from, over its own (a
# ConfigRecord in the messages of a sweep's run that reads them differently)
RUN_CONFIG = "run-config"

# ---- ConfigRecord keys sent to sites
SERVER_ROUND = "server-round"  # Flower's FedAvg adds this too
MODEL_VERSION = "model-version"
SITE_ALGORITHM = "site-algorithm"  # which algorithm's mod handles the message at the site
# ... its values: the algorithms whose site half is a ClientApp mod (strategies/mods)
LOCAL_SGD = "local-sgd"
DELAYED = "delayed"
FETCHSGD = "fetchsgd"
SKETCHED_SGD = "sketched-sgd"
LR = "lr"
MOMENTUM = "momentum"
LOCAL_STEPS = "local-steps"
LOCAL_EPOCHS = "local-epochs"
BATCH_SIZE = "batch-size"
SEED = "seed"
# delayed updates (strategies/delayed.py): the round is the period the site computes, the
# model version the (D-round-old) model it is sent
DELAY = "delay"
COMPENSATE = "compensate"
INCLUDED_PERIODS = "included-periods"  # the site's periods that made it into the averages
# streaming sync (strategies/fragments.py): F, the fragments the model is split into; period
# q's update carries fragment (q − 1) mod F
FRAGMENTS = "fragments"
# upload compression (strategies/codecs.py): the codec a site encodes its update with;
# a compressed reply names it in its own ``config`` record
CODEC = "codec"
# sketched aggregation (strategies/fetchsgd.py): the sketch's hashes and shape, and (also
# streaming sync's) the version whose changes a sparse download carries (-1: the whole model)
SKETCH_SEED = "sketch-seed"
SKETCH_ROWS = "sketch-rows"
SKETCH_COLS = "sketch-cols"
# arrays a sketched site sends whole beside its table (strategies/averaged_arrays.py)
AVERAGED_ARRAYS = "averaged-arrays"
SYNC_FROM = "sync-from"
# the float arrays a FetchSGD site's training left exactly as they were (frozen weights): the
# server never picks their coordinates from the sketch in a round where no site changed them
UNCHANGED_ARRAYS = "unchanged-arrays"
# Sketched-SGD (strategies/sketched_sgd.py): which of a step's two rounds, the round whose
# sketches chose the candidates, the step momentum, the step whose coordinates to zero
STEP_PHASE = "sketch-phase"  # values: strategies.mods.sketched_sgd.StepPhase
SKETCHED_ROUND = "sketched-round"
STEP_MOMENTUM = "step-momentum"
ZERO_STEP = "zero-step"
# a site's persistent state (strategies/mods): whether the server relies on the site holding
# state from earlier messages (a site that lost it, a restarted SuperNode, says so)
STATE_EXPECTED = "state-expected"
# set by the engine in every training message's config: the message's place among those sent
# to this site (1, 2, ...), and a stable id of the run (the same after a resume). A site
# restores the state it had after work SITE_WORK − 1 of RUN_KEY (strategies/mods/contract.py)
# and draws its data order from the work index, so a resumed run repeats the same work.
SITE_WORK = "site-work"
RUN_KEY = "run-key"

# ---- MetricRecord keys sent back by sites
NUM_EXAMPLES = "num-examples"  # Flower's weighting key
TRAIN_LOSS = "train_loss"  # spelled as in Flower's quickstarts
TRAIN_LOSS_ALIASES = ("train_loss", "train-loss", "loss")
COMPUTE_SECONDS = "compute-seconds"
# the received model's loss on the first mini-batch, before any step: the reference the
# server compares later train losses with (flplatform/engine/divergence.py)
FIRST_BATCH_LOSS = "first-batch-loss"
PERIOD = "period"  # delayed updates: the period an accumulated step was computed for
STATE_LOST = "state-lost"  # 1: the site's mod found its kept state gone (a restart)
# 1: a delayed site found its codec's residual gone but its periods kept (they were saved
# apart): the server keeps counting its periods, and notes the residual restarted at zero
RESIDUAL_LOST = "residual-lost"
# ---- a mod's reply config: what its arrays are, and why a state-lost reply has none
UPDATE_KIND = "update"  # "delta": arrays are x_n − x (or a step), not a model
# the algorithm whose mod answered (the message's site-algorithm; local-sgd without one):
# the server checks its strategy's site half was there (flplatform.engine.replies)
SITE_MOD = "site-mod"
# ... and the protocol it speaks: the meaning of the messages flplatform's mods and
# strategies exchange. Raised when that meaning changes, so that a site and a server
# running flplatform releases that differ there refuse each other at the first reply.
SITE_MOD_PROTOCOL = "site-mod-protocol"
MOD_PROTOCOL = 1
DELTA = "delta"
STATE_LOST_DETAIL = "state-lost"
EVAL_LOSS = "eval_loss"
EVAL_ACCURACY = "eval_acc"
# a mod's error reply when it refuses what the site's own train function returned (no
# arrays or num-examples, another shape, NaN): Flower's ErrorCode.MOD_FAILED_PRECONDITION,
# which its own central-DP mod answers with. The server records it rejected, with the reason.
SITE_REFUSED_CODE = 6
SITE_REFUSED_PREFIX = "flplatform mod: "  # its reason's start: Flower's own mods use code 6 too

# ---- site-info query reply (ConfigRecord); a plain Flower ClientApp need not answer it
SITE_NAME = "site-name"
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
DEVICE = "device"
# the largest per-feature root-mean-square of the site's training features (clients/scaling.py):
# far from 1, it is the likely reason training diverges
FEATURE_SCALE = "feature-scale"
DATA_PATH = "data-path"  # node config of a deployed site: its own data file
STATE_DIR = "state-dir"  # node config: where the site keeps its snapshots (strategies/mods)

# ---- the site's persistent state (Flower's context.state), one record per mod
SITE_STATE = "flplatform-site"  # the built-in app's counters (ConfigRecord)
TRAININGS = "trainings"  # training messages the built-in app has run
DELAYED_STATE = "flplatform-delayed"  # delayed updates: kept periods and carry
CODEC_STATE = "flplatform-codec"  # upload compression: the error-feedback residual
FETCHSGD_STATE = "flplatform-fetchsgd"  # the model a FetchSGD site holds, and its version
SKETCHED_STATE = "flplatform-sketched-sgd"  # model, version, u, v and progress
# which work (SITE_WORK) of which run (RUN_KEY) wrote each record above (ConfigRecord)
WORK_TAGS = "flplatform-work"
ATTACK_STATE = "flplatform-attack"  # clients.attacks (red-team tool): prefix of its records

# ---- global metrics written to the ledger
ACCURACY = "accuracy"
LOSS = "loss"
# Federated evaluation's aggregate, written beside the server's own: "site_" + name.
SITE_ACCURACY = "site_" + ACCURACY
SITE_LOSS = "site_" + LOSS
