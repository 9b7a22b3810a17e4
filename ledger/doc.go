// Package ledger is onceflow's client-side deduplication of model calls (docs/providers.md): the
// llm_calls table and the state machine around it, for providers that ignore
// Idempotency-Key, which is most of them.
//
// # The state machine
//
// One row per call, keyed by Key(work, request): derived from the work (job id and
// step, see Work) and the SHA-256 of the canonical request, never from the attempt.
//
//	(none) --Begin: insert--> in_flight(owner, lease) --Succeed--> succeeded (response, raw bytes)
//	                              |   \--Fail(clear)------> failed (error) --Begin: claim--> in_flight
//	                              |--Fail(ambiguous)--> in_flight, no owner, attempt+1, ambiguous+1 --Begin: claim--> in_flight
//	                              \--owner silent for Lease--> Begin: take over, attempt+1, ambiguous+1
//
// In detail:
//
//   - The row is inserted in_flight BEFORE the request goes out (Begin, one round trip
//     that also reads a conflicting row). A conflicting Begin finds another attempt's
//     work: a succeeded row is replayed (no call); a live owner is waited for, polling
//     with backoff up to Config.Wait; a failed row, or one an attempt released after an
//     ambiguous failure, is claimed at once; a row whose owner stopped renewing its
//     lease for Config.Lease (ONCEFLOW_LEDGER_LEASE) is taken over, that attempt
//     counted as ambiguous, so a crashed worker never blocks its job for long.
//   - A live owner renews its lease every Lease/3 while the call runs.
//   - Succeed records the response (as jsonb, and its raw bytes for byte-identical
//     replay) in a commit of its own, or, with SucceedTx, inside the caller's
//     transaction together with the downstream write it causes. The first response
//     recorded wins: an attempt that lost its lease and succeeds late gets the
//     recorded one back, so every effect is derived from one response.
//   - An ambiguous failure (a timeout or a reset after the request was sent: see
//     IsAmbiguous) leaves the row in_flight, the record that the work may have been
//     done, with the attempt number advanced and the failure counted; a clear failure
//     (the provider answered with an error) marks the row failed with the error.
//   - Rows expire Config.Retention (ONCEFLOW_LEDGER_RETENTION) after their first
//     attempt, or after their success when that is later (a success moves expires_at,
//     never earlier), which must cover the retry horizon plus the longest a job can
//     wait in a queue; Purge (and Run, periodically) deletes expired rows in batches.
//
// Client wraps any llm.Client so that every Complete and Stream goes through the ledger;
// Stream persists partial output on the row in batches and records the row only at the
// final chunk. ToolKeys derives the downstream idempotency key of tool calls
// (package toolkey) and detects providers whose tool-call ids are unstable.
//
// # What it protects, and what it cannot
//
// It protects your side effects: a redelivered job whose response was recorded never
// calls the model again, and effects derived from a recorded response agree. It does not
// protect your bill: a generation that completed on the provider before the connection
// dropped is charged whether or not you received it, and the retry is a second
// generation. The ambiguous counts (onceflow_llm_ledger_ambiguous_total, the llm_calls
// section of `onceflow audit`) measure exactly that cost. Put a provider that honours
// Idempotency-Key (or onceflow gateway) behind it and the retry becomes a replay.
//
// # Costs
//
// A new call alone costs two round trips and two commits: the in-flight insert and the
// success. Calls that arrive together share them (group commit, Config.GroupLinger):
// their inserts, and their answers, go to PostgreSQL as one transaction, one round trip
// and one WAL flush, with the same guarantees per call. An answer recorded under
// DeferFlush commits without waiting for its flush, for a caller whose durable commit
// follows (onceflow's job runtime: the job's Commit). Config.RelaxedInsert commits the
// insert without waiting for the WAL flush (synchronous_commit off for that statement
// alone): a PostgreSQL crash can then lose the in-flight row, which is an accounting
// record (one ambiguous attempt not counted), never an effect, because effects wait
// for a durable commit after the answer (Succeed's own, or the caller's under
// DeferFlush), whose WAL flush also makes the earlier insert durable.
package ledger
