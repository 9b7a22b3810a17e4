# onceflow: the two commands a new user needs are `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
GO ?= go
# -trimpath for every go command the targets run, their subprocesses' included (the test
# binaries' builds of ./cmd/onceflow): source paths are then the module's, not the
# checkout's, so a fresh clone reuses the build cache of another checkout instead of
# compiling every package again (reproducible builds too).
export GOFLAGS := -trimpath $(GOFLAGS)
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2
# Static security analysis; every finding is fixed or justified inline with
# `#nosec RULE -- why` (docs/development.md).
GOSEC := github.com/securego/gosec/v2/cmd/gosec@v2.30.0
VERSION := $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X github.com/onceflow/onceflow/cli.version=$(VERSION)
FUZZTIME ?= 10s
# Go test timeout of each package's test binary; the slowest takes about a minute and a half.
TEST_TIMEOUT ?= 10m
# Tests of one package run at once (t.Parallel): most wait on Redis, PostgreSQL, a
# subprocess or an outage's timer rather than use a core, so more than the 2 of a 2-core
# machine's default keep it busy.
TEST_PARALLEL ?= 8
# Packages tested at once (go test -p): the 2 cores' default. With 4, the two cores were
# saturated (the test binaries, the shared PostgreSQL and the linker) and timing tests
# failed in a different package each run; with 2 the same suite took 6m03s against 6m51s
# with 4 (2026-12-05, same machine).
TEST_PACKAGES ?= 2
# The test binaries' flags: -race, no cached results, the two kinds of parallelism, and
# no DWARF (-ldflags=-w), which nothing in a test run reads and which is a good part of
# linking each test binary.
TEST_FLAGS = -race -count=1 -p $(TEST_PACKAGES) -parallel $(TEST_PARALLEL) -ldflags=-w -timeout $(TEST_TIMEOUT)
# The binaries the tests run as processes, built before them (internal/testenv.Binary,
# ProductionBinary): linked alone, a few seconds; linked by the first test that needs
# one while the other test binaries ran, over a minute.
TEST_BINARIES = ONCEFLOW_TEST_BINARY=$(CURDIR)/.dev/bin/onceflow-test ONCEFLOW_TEST_PRODUCTION_BINARY=$(CURDIR)/.dev/bin/onceflow
# The root module's long tests (testenv.Long, or testing.Short in the examples, whose
# code users copy): make test skips them (-short), make test-long runs them, in the
# packages of LONG_PKGS.
LONG_TESTS = ^(TestRunOnARedisClusterFromANodeWithoutTheQueue|TestOne429PausesEveryWorkProcess|TestBatchLaneKilledAtEachPointAnswersEverySummaryOnce|TestShadowsLeaveProductionTheProvidersLimit|TestRedisNodeUpGaugeFollowsFailover|TestSentinelFailoverLosesNoAcceptedJob|TestAnswerArrivingDuringALongOutageIsRecordedOnceItIsBack|TestRetryRightAfterAnOutageLongerThanTheLeaseJoinsTheLiveCall|TestRedisClusterKitFailsOver|TestWorkerKilledBetweenCommitAndAck|TestRelayKilledBetweenSendAndMark|TestHeldTicketKilledWhileHeldThenReleasedSendsOnce|TestRejectedTicketSendsNothingAcrossAKill|TestReleasedTicketKilledInItsCommitSendsOnce|TestRestartAfterTheRefundReplaysTheChangingReadAndRefundsOnce|TestEventsResumeAcrossAKillWithoutRepeats|TestPostgresOutageDuringCommitSpendsNoDelivery|TestPostgresBreakerHoldsTheWorkersBack|TestModelOutageTripsTheLLMBreaker|TestAnswerAnEnqueuedJobCarriesSurvivesAPostgresCrash|TestAnswerAnEnqueuedJobCarriesSurvivesAPostgresCrashWhenACommitTxBesideItRecordedIt|TestAnswerADoStepActedOnSurvivesAPostgresCrash)$$
LONG_PKGS = ./cli . ./gateway ./internal/testenv/cluster ./examples/triage ./examples/agent
# Build tag of the test aids compiled only into the binary the tests run
# (internal/testenv.Binary): `onceflow work --test-handler`. `make build` leaves them out.
TEST_TAGS := onceflowtest
# The packages with files that TEST_TAGS selects or leaves out (//go:build lines): the
# only ones whose build the tag changes, so the only ones lint checks again with it.
TAGGED_PKGS := $(shell git grep -l '^//go:build.*$(TEST_TAGS)' -- '*.go' | xargs -r -n1 dirname | sort -u | sed 's|^|./|')

.PHONY: all build test test-long ui-screenshots demo lint fuzz bench bench-limits bench-gateway bench-ui chaos chaos-outage chaos-cluster chaos-agent services-up services-down clean example-minimal example-triage example-agent

all: build

## build: compile ./bin/onceflow
build:
	$(GO) build -ldflags "$(LDFLAGS)" -o bin/onceflow ./cmd/onceflow

## test: start real Redis and PostgreSQL (scripts/dev-services) and run the library's and
## the product's tests (the root module) with -race
test:
	scripts/dev-services up
	$(GO) build -ldflags=-w -tags $(TEST_TAGS) -o .dev/bin/onceflow-test ./cmd/onceflow
	$(GO) build -ldflags "-w $(LDFLAGS)" -o .dev/bin/onceflow ./cmd/onceflow
	eval "$$(scripts/dev-services env)" && $(TEST_BINARIES) $(GO) test -short $(TEST_FLAGS) ./...

## test-long: the long profiles: the queue's and the idempotency store's suites again on a
## local Redis Cluster they start (3 primaries on loopback; docs/operations.md, "Redis
## Cluster"), the root module's long tests (LONG_TESTS: processes by the dozen), then the lab's tests (lab/: the short chaos profiles, the operator UI in a
## real Chromium, which scripts/install-chromium installs when root, the gateway under
## the official SDKs, the benchmarks' own tests)
test-long:
	scripts/dev-services up
	scripts/install-chromium || echo "chromium not installed: the browser tests will be skipped"
	eval "$$(scripts/dev-services env)" && ONCEFLOW_TEST_REDIS_CLUSTER=local $(GO) test -count=1 -parallel $(TEST_PARALLEL) -ldflags=-w -timeout $(TEST_TIMEOUT) ./queue ./idempotency/redisstore
	$(GO) build -ldflags=-w -tags $(TEST_TAGS) -o .dev/bin/onceflow-test ./cmd/onceflow
	# cli's first, with the machine to itself (two of them time requests across processes
	# to the millisecond), then the other packages' together.
	eval "$$(scripts/dev-services env)" && ONCEFLOW_TEST_BINARY=$(CURDIR)/.dev/bin/onceflow-test $(GO) test $(TEST_FLAGS) -run '$(LONG_TESTS)' $(firstword $(LONG_PKGS))
	eval "$$(scripts/dev-services env)" && ONCEFLOW_TEST_BINARY=$(CURDIR)/.dev/bin/onceflow-test $(GO) test $(TEST_FLAGS) -run '$(LONG_TESTS)' $(wordlist 2,99,$(LONG_PKGS))
	eval "$$(scripts/dev-services env)" && cd lab && CHAOS_DURATION=$${CHAOS_DURATION:-30s} CHAOS_OUTAGE_POSTGRES=$${CHAOS_OUTAGE_POSTGRES:-12s} \
	  CHAOS_OUTAGE_MODEL=$${CHAOS_OUTAGE_MODEL:-12s} CHAOS_OUTAGE_GAP=$${CHAOS_OUTAGE_GAP:-5s} \
	  $(GO) test -race -count=1 -p $(TEST_PACKAGES) -ldflags=-w -timeout $(TEST_TIMEOUT) ./...

## ui-screenshots: the operator UI's browser tests, saving their screenshots (1280x800
## PNGs) in docs/ui/ for docs/ui.md
ui-screenshots:
	scripts/dev-services up
	scripts/install-chromium
	eval "$$(scripts/dev-services env)" && cd lab && \
	  ONCEFLOW_UI_SCREENSHOTS=$(CURDIR)/docs/ui ONCEFLOW_REQUIRE_BROWSER=1 $(GO) test -count=1 -run '^TestBrowser' ./browsertest/

## demo: the service end to end against real Redis and PostgreSQL (under a minute);
## CLUSTER=1 runs it on a local Redis Cluster of its own (3 primaries, 3 replicas, the
## queue in 3 partitions, WAIT 1 on every accept)
demo:
	scripts/demo $(if $(filter 1 yes true,$(CLUSTER)),--cluster) $(if $(LANE),--lane $(LANE))

## lint: the repository check (no file over 1 MiB, no executable binary tracked), gofmt,
## go vet and staticcheck (pinned) on both modules, and gosec (pinned) on the root module,
## the code that ships; the packages the test build tag (TEST_TAGS) changes are checked
## again with it
lint:
	scripts/check-repo
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) vet -tags $(TEST_TAGS) $(TAGGED_PKGS)
	cd lab && $(GO) vet ./...
	$(GO) run $(STATICCHECK) ./...
	$(GO) run $(STATICCHECK) -tags $(TEST_TAGS) $(TAGGED_PKGS)
	cd lab && $(GO) run $(STATICCHECK) ./...
	$(GO) run $(GOSEC) -quiet ./...
	$(GO) run $(GOSEC) -quiet -tags $(TEST_TAGS) $(TAGGED_PKGS)

## fuzz: run each fuzz target for FUZZTIME (default 10s)
fuzz:
	scripts/dev-services up
	eval "$$(scripts/dev-services env)"; \
	for pkg in $$($(GO) list ./...); do \
	  for target in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz' || true); do \
	    echo "== $$pkg $$target"; \
	    $(GO) test -run '^$$' -fuzz "^$$target\$$" -fuzztime $(FUZZTIME) $$pkg; \
	  done; \
	done

## chaos: the long chaos runs: kill -9 (CHAOS_DURATION, default 5m; CHAOS_SEED to replay a
## run), then the outage profile (CHAOS_OUTAGE_POSTGRES / _MODEL / _REDIS, default 2m, 2m,
## 1m, with CHAOS_OUTAGE_GAP, default 20s, of plain load around them), then the cluster
## profile (CHAOS_CLUSTER_DURATION, default 2m) with WAIT 1 and without WAIT (its loss
## measured), and the agent profile (examples/agent's roles killed, CHAOS_AGENT_DURATION,
## default 3m); the kill -9 run shadows every summary's model call (CHAOS_SHADOW=1, its
## shadows checked to cause no effect); chaos-outage, chaos-cluster and chaos-agent run
## one profile each
CHAOS_DURATION ?= 5m
CHAOS_OUTAGE_POSTGRES ?= 2m
CHAOS_OUTAGE_MODEL ?= 2m
CHAOS_OUTAGE_REDIS ?= 1m
CHAOS_OUTAGE_GAP ?= 20s
CHAOS_CLUSTER_DURATION ?= 2m
CHAOS_AGENT_DURATION ?= 3m
CHAOS_SHADOW ?= 1
CHAOS_ENV = CHAOS_DURATION=$(CHAOS_DURATION) CHAOS_SEED=$(CHAOS_SEED) CHAOS_OUTAGE_POSTGRES=$(CHAOS_OUTAGE_POSTGRES) \
	CHAOS_OUTAGE_MODEL=$(CHAOS_OUTAGE_MODEL) CHAOS_OUTAGE_REDIS=$(CHAOS_OUTAGE_REDIS) CHAOS_OUTAGE_GAP=$(CHAOS_OUTAGE_GAP) \
	CHAOS_CLUSTER_DURATION=$(CHAOS_CLUSTER_DURATION) CHAOS_CLUSTER_NOWAIT=1 CHAOS_AGENT_DURATION=$(CHAOS_AGENT_DURATION) CHAOS_SHADOW=$(CHAOS_SHADOW)
chaos:
	scripts/dev-services up
	cd lab && $(CHAOS_ENV) $(GO) test -count=1 -run '^(TestChaos|TestChaosOutage|TestChaosCluster|TestChaosClusterNoWait|TestChaosAgent)$$' -v -timeout 2h ./chaos

chaos-cluster:
	scripts/dev-services up
	cd lab && $(CHAOS_ENV) $(GO) test -count=1 -run '^(TestChaosCluster|TestChaosClusterNoWait)$$' -v -timeout 2h ./chaos

chaos-agent:
	scripts/dev-services up
	cd lab && $(CHAOS_ENV) $(GO) test -count=1 -run '^TestChaosAgent$$' -v -timeout 2h ./chaos

chaos-outage:
	scripts/dev-services up
	cd lab && $(CHAOS_ENV) $(GO) test -count=1 -run '^TestChaosOutage$$' -v -timeout 2h ./chaos

## bench: onceflow's worker beside asynq and River (bench/ module), the guarded POST
## beside a bare handler, an agent job's recorded loop beside the same loop by hand, and
## 100,000 jobs parked on a signal (their Redis memory, the signal-to-run latency),
## production's goodput with shadows at 0, 10 and 100 % and behind a passing gate;
## figures go to docs/BENCHMARKS.md
bench:
	scripts/dev-services up
	eval "$$(scripts/dev-services env)" && cd lab && $(GO) run ./bench $(BENCH_ARGS)
	eval "$$(scripts/dev-services env)" && $(GO) test -run '^$$' -bench Idempotency -benchtime 1x ./idempotency/redisstore/
	eval "$$(scripts/dev-services env)" && $(GO) test -run '^$$' -bench AgentLoop -benchtime 2000x .
	eval "$$(scripts/dev-services env)" && $(GO) test -run '^$$' -bench ParkedJobs -benchtime 100000x -timeout 60m .
	eval "$$(scripts/dev-services env)" && $(GO) test -run '^$$' -bench 'Shadows|Gates|LedgerRequests' -benchtime 2000x -count 2 . && \
	  $(GO) test -run '^$$' -bench 'BatchLane' -benchtime 10000x -count 1 .

## bench-limits: provider admission control (lab/limitbench): 4 workers against
## fake-llm --rpm 600 --tpm 200000 with admission configured, learnt and off (goodput, 429s),
## then a late tenant's wait behind another's backlog; about 11 minutes; prints the report
## (figures go to docs/BENCHMARKS.md by hand)
bench-limits:
	scripts/dev-services up
	eval "$$(scripts/dev-services env)" && cd lab && ONCEFLOW_LIMITS_BENCH=1 $(GO) test -count=1 -run '^TestLimitsBench$$' -v -timeout 60m ./limitbench

## bench-ui: the operator UI's server-side render times with 100,000 jobs and 1,000 dead
## letters in the stores (adminui); about a minute; prints the report
bench-ui:
	scripts/dev-services up
	eval "$$(scripts/dev-services env)" && ONCEFLOW_UI_BENCH=1 $(GO) test -count=1 -run '^TestRenderTimeWithLargeStores$$' -v -timeout 20m ./adminui

## bench-gateway: onceflow gateway's overhead (lab/gatewaybench): latency at
## concurrency 1 and throughput at 16 against direct calls to fake-llm (keyed unary, keyed
## stream, keyless), then joiners of live streams on the same and another gateway process;
## about 6 minutes; prints the report (figures go to docs/BENCHMARKS.md by hand)
bench-gateway:
	scripts/dev-services up
	eval "$$(scripts/dev-services env)" && cd lab && ONCEFLOW_GATEWAY_BENCH=1 $(GO) test -count=1 -run '^TestGatewayBench$$' -v -timeout 60m ./gatewaybench

## example-minimal: the smallest workflow's test (examples/minimal), against real Redis and PostgreSQL
example-minimal:
	scripts/dev-services up
	eval "$$(scripts/dev-services env)" && $(GO) test -race -count=1 ./examples/minimal/

## example-triage: the support-ticket triage agent's tests, crash tests included (examples/triage)
example-triage:
	scripts/dev-services up
	eval "$$(scripts/dev-services env)" && $(GO) test -race -count=1 ./examples/triage/

## example-agent: the order-support agent's tests, crash tests included (examples/agent)
example-agent:
	scripts/dev-services up
	eval "$$(scripts/dev-services env)" && $(GO) test -race -count=1 ./examples/agent/

services-up:
	scripts/dev-services up

services-down:
	scripts/dev-services down

clean:
	rm -rf bin
