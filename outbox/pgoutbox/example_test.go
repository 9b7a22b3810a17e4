package pgoutbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
)

// The job handler writes its result and the intent to email in one transaction: both
// commit or neither does. The relay sends the row afterwards.
func ExampleInsert() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://onceflow@127.0.0.1:15432/onceflow")
	if err != nil {
		log.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback(ctx)
	jobID := "6f1c0c4e-1b8e-5d47-9a55-2f0f4b7a0c11"
	var won string
	err = tx.QueryRow(ctx, `INSERT INTO summaries (job_id, tenant, summary) VALUES ($1, 'acme', 'text')
		ON CONFLICT (job_id) DO NOTHING RETURNING job_id`, jobID).Scan(&won)
	if err != nil {
		return // a concurrent delivery won the race: it writes the outbox row
	}
	_, err = pgoutbox.Insert(ctx, tx, outbox.Message{
		Topic:     "email.summary_ready",
		DedupeKey: "summary_ready:" + jobID,
		Payload:   json.RawMessage(`{"job_id":"` + jobID + `","to":"user@example.com"}`),
	})
	if errors.Is(err, pgoutbox.ErrDuplicate) {
		return // the UNIQUE dedupe_key backstop: roll back
	}
	if err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		log.Fatal(err)
	}
}

// A writer whose own first-writer-wins guard runs first in the same batch queues the
// strict insert: an existing dedupe key then fails the batch, rolling back all of it.
func ExampleQueueInsert() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://onceflow@127.0.0.1:15432/onceflow")
	if err != nil {
		log.Fatal(err)
	}
	jobID := "6f1c0c4e-1b8e-5d47-9a55-2f0f4b7a0c11"
	b := &pgx.Batch{}
	b.Queue(`INSERT INTO summaries (job_id, tenant, summary) VALUES ($1, 'acme', 'text')`, jobID) // no ON CONFLICT: the guard
	if err := pgoutbox.QueueInsert(b, outbox.Message{
		Topic:     "email.summary_ready",
		DedupeKey: "summary_ready:" + jobID,
		Payload:   json.RawMessage(`{"job_id":"` + jobID + `","to":"user@example.com"}`),
	}); err != nil {
		log.Fatal(err)
	}
	err = pool.SendBatch(ctx, b).Close() // one round trip, one implicit transaction
	if pgoutbox.IsDuplicate(err) {
		log.Print("the email exists without its summary: a person must look")
	}
}
