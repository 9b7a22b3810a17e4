package summaries_test

import (
	"fmt"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/summaries"
)

// A job id is the UUIDv5 of the request's idempotency scope under JobNamespace, so any
// client can compute the id of the job its key created (Python: uuid.uuid5(ns, scope)).
func ExampleJobID() {
	scope := idempotency.Scope{Tenant: "acme", Method: "POST", Path: "/v1/summaries", Key: "order-7f3c2a91-0001"}
	fmt.Println(summaries.JobNamespace)
	fmt.Printf("%s\n", scope.Encode())
	fmt.Println(summaries.JobID(scope))
	// Output:
	// 82d05cc3-eef7-5704-933f-413aa8eeee8c
	// idem1;4:acme,4:POST,13:/v1/summaries,19:order-7f3c2a91-0001,
	// 939491ce-6447-51a8-8a71-a625fd0a16a4
}

// The fingerprint of a request is the SHA-256 of its canonical form: the validated body
// re-encoded with a fixed field order and no insignificant whitespace.
func ExampleRequest_Canonical() {
	r, err := summaries.DecodeRequest([]byte("{\n  \"notify\": \"team@example.com\",\n  \"text\": \"Q3 review\"\n}"))
	if err != nil {
		panic(err)
	}
	fmt.Printf("%s\n", r.Canonical())
	fmt.Println(idempotency.Fingerprint(r.Canonical()))
	// Output:
	// {"text":"Q3 review","notify":"team@example.com"}
	// 9ba17116dd01e7ead421212b95e1892f21fcdd6a504638aa48ff485f1e44fc22
}
