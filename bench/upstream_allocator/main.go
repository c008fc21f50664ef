// Command upstream-allocator runs ResourceClaims through the Kubernetes scheduler's own
// structured allocator (k8s.io/dynamic-resource-allocation/structured, release-1.35), on the
// same files `tessera explain` reads, and prints its allocation as JSON, so that the two answers
// can be compared. docs/explain.md ("Checking against the scheduler's allocator") says how to
// build and run it; no make target builds it (the project has no Go toolchain).
//
//	upstream-allocator -node NODE -claims CLAIM.yaml -classes CLASSES.yaml -slices SLICES.yaml \
//	    [-allocated ALLOCATED.yaml] [-features AdminAccess,PrioritizedList,...]
//
// The API it calls (release-1.35 structured/allocator.go): structured.NewAllocator(ctx,
// features, allocatedState, classLister, slices, celCache) picks the stable, incubating or
// experimental variant from the features, and Allocate(ctx, node, claims) allocates the claims
// together, as the scheduler does for one pod's claims.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
)

// classLister serves the DeviceClasses of the files (structured.DeviceClassLister).
type classLister map[string]*resourceapi.DeviceClass

func (c classLister) List() ([]*resourceapi.DeviceClass, error) {
	out := make([]*resourceapi.DeviceClass, 0, len(c))
	for _, class := range c {
		out = append(out, class)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

func (c classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	if class, ok := c[name]; ok {
		return class, nil
	}
	return nil, apierrors.NewNotFound(resourceapi.Resource("deviceclasses"), name)
}

// documents reads every object of a multi-document YAML or JSON file (List objects are opened
// into their items) as JSON, with its kind.
func documents(path string) ([]json.RawMessage, []string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	var raws []json.RawMessage
	var kinds []string
	decoder := yaml.NewYAMLOrJSONDecoder(f, 4096)
	for {
		var raw json.RawMessage
		if err := decoder.Decode(&raw); errors.Is(err, io.EOF) {
			return raws, kinds, nil
		} else if err != nil {
			return nil, nil, fmt.Errorf("%s: %w", path, err)
		}
		if len(raw) == 0 || string(raw) == "null" {
			continue
		}
		var head struct {
			Kind  string            `json:"kind"`
			Items []json.RawMessage `json:"items"`
		}
		if err := json.Unmarshal(raw, &head); err != nil {
			return nil, nil, fmt.Errorf("%s: %w", path, err)
		}
		if strings.HasSuffix(head.Kind, "List") {
			for _, item := range head.Items {
				var itemHead struct {
					Kind string `json:"kind"`
				}
				if err := json.Unmarshal(item, &itemHead); err != nil {
					return nil, nil, fmt.Errorf("%s: %w", path, err)
				}
				raws, kinds = append(raws, item), append(kinds, itemHead.Kind)
			}
			continue
		}
		raws, kinds = append(raws, raw), append(kinds, head.Kind)
	}
}

// inputs are the objects of the files, typed.
type inputs struct {
	claims    []*resourceapi.ResourceClaim
	classes   classLister
	slices    []*resourceapi.ResourceSlice
	allocated []*resourceapi.ResourceClaim
	nodes     map[string]*v1.Node
}

func (in *inputs) read(path string, allocated bool) error {
	raws, kinds, err := documents(path)
	if err != nil {
		return err
	}
	for i, raw := range raws {
		where := fmt.Sprintf("%s: document %d (%s)", path, i, kinds[i])
		var err error
		switch kinds[i] {
		case "ResourceClaim":
			claim := &resourceapi.ResourceClaim{}
			if err = json.Unmarshal(raw, claim); err == nil {
				if allocated {
					in.allocated = append(in.allocated, claim)
				} else {
					in.claims = append(in.claims, claim)
				}
			}
		case "ResourceClaimTemplate":
			// the claim the template makes (its spec.spec), named after the template
			template := &resourceapi.ResourceClaimTemplate{}
			if err = json.Unmarshal(raw, template); err == nil && !allocated {
				in.claims = append(in.claims, &resourceapi.ResourceClaim{
					ObjectMeta: metav1.ObjectMeta{Name: template.Name, Namespace: template.Namespace},
					Spec:       template.Spec.Spec,
				})
			}
		case "DeviceClass":
			class := &resourceapi.DeviceClass{}
			if err = json.Unmarshal(raw, class); err == nil {
				in.classes[class.Name] = class
			}
		case "ResourceSlice":
			slice := &resourceapi.ResourceSlice{}
			if err = json.Unmarshal(raw, slice); err == nil {
				in.slices = append(in.slices, slice)
			}
		case "Node":
			node := &v1.Node{}
			if err = json.Unmarshal(raw, node); err == nil {
				in.nodes[node.Name] = node
			}
		default:
			fmt.Fprintf(os.Stderr, "%s: skipped\n", where)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", where, err)
		}
	}
	return nil
}

// allocatedState is what the scheduler gathers from the allocated claims: a result with
// adminAccess holds nothing, a result with a shareID holds one share (and its consumed
// capacity) of a device that allows multiple allocations, any other holds the whole device.
func allocatedState(claims []*resourceapi.ResourceClaim) structured.AllocatedState {
	state := structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
	for _, claim := range claims {
		if claim.Status.Allocation == nil {
			continue
		}
		for _, r := range claim.Status.Allocation.Devices.Results {
			if r.AdminAccess != nil && *r.AdminAccess {
				continue
			}
			id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
			if r.ShareID == nil {
				state.AllocatedDevices.Insert(id)
				continue
			}
			state.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, r.ShareID))
			state.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(id, r.ConsumedCapacity))
		}
	}
	return state
}

// features parses -features: the names of structured.Features' fields that are on.
func features(list string) (structured.Features, error) {
	var f structured.Features
	for _, name := range strings.Split(list, ",") {
		switch strings.TrimSpace(name) {
		case "":
		case "AdminAccess":
			f.AdminAccess = true
		case "ConsumableCapacity":
			f.ConsumableCapacity = true
		case "DeviceBindingAndStatus":
			f.DeviceBindingAndStatus = true
		case "DeviceTaints":
			f.DeviceTaints = true
		case "PartitionableDevices":
			f.PartitionableDevices = true
		case "PrioritizedList":
			f.PrioritizedList = true
		default:
			return f, fmt.Errorf("-features: unknown feature %q (AdminAccess, ConsumableCapacity,"+
				" DeviceBindingAndStatus, DeviceTaints, PartitionableDevices, PrioritizedList)", name)
		}
	}
	return f, nil
}

type files []string

func (f *files) String() string     { return strings.Join(*f, ",") }
func (f *files) Set(v string) error { *f = append(*f, v); return nil }

type claimAnswer struct {
	Claim      string                        `json:"claim"`
	Allocation *resourceapi.AllocationResult `json:"allocation"`
}

// answer: fits (an allocation for every claim), or not: no allocation (error empty), an error
// of this node only (failedOnNode: structured.ErrFailedAllocationOnNode, e.g. an invalid pool),
// or an error of the claims or classes that stops the scheduler on every node (a CEL runtime
// error, an unknown DeviceClass, too many devices for allocationMode All).
type answer struct {
	Node         string        `json:"node"`
	Fits         bool          `json:"fits"`
	Error        string        `json:"error,omitempty"`
	FailedOnNode bool          `json:"failedOnNode,omitempty"`
	Claims       []claimAnswer `json:"claims"`
}

func run() error {
	var claimFiles, classFiles, sliceFiles, allocatedFiles files
	nodeName := flag.String("node", "", "the node to allocate on (its name; a Node object in the"+
		" -slices files gives its labels)")
	featureList := flag.String("features",
		"AdminAccess,ConsumableCapacity,DeviceTaints,PartitionableDevices,PrioritizedList",
		"structured.Features that are on, comma-separated (what `tessera explain` models)")
	flag.Var(&claimFiles, "claims", "ResourceClaims and ResourceClaimTemplates (repeatable)")
	flag.Var(&classFiles, "classes", "DeviceClasses (repeatable)")
	flag.Var(&sliceFiles, "slices", "ResourceSlices and Nodes (repeatable)")
	flag.Var(&allocatedFiles, "allocated", "claims allocated already, with status.allocation (repeatable)")
	flag.Parse()
	if *nodeName == "" || len(claimFiles) == 0 || len(sliceFiles) == 0 {
		return errors.New("give -node, -claims and -slices (see -help)")
	}
	feats, err := features(*featureList)
	if err != nil {
		return err
	}
	in := &inputs{classes: classLister{}, nodes: map[string]*v1.Node{}}
	for _, group := range []struct {
		paths     files
		allocated bool
	}{{classFiles, false}, {sliceFiles, false}, {claimFiles, false}, {allocatedFiles, true}} {
		for _, path := range group.paths {
			if err := in.read(path, group.allocated); err != nil {
				return err
			}
		}
	}
	node := in.nodes[*nodeName]
	if node == nil {
		node = &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: *nodeName}}
	}
	ctx := context.Background()
	celCache := cel.NewCache(100, cel.Features{EnableConsumableCapacity: feats.ConsumableCapacity})
	allocator, err := structured.NewAllocator(ctx, feats, allocatedState(in.allocated), in.classes, in.slices, celCache)
	if err != nil {
		return err
	}
	results, err := allocator.Allocate(ctx, node, in.claims)
	out := answer{Node: *nodeName, Fits: err == nil && len(results) == len(in.claims)}
	if err != nil {
		out.Error = err.Error()
		out.FailedOnNode = errors.Is(err, structured.ErrFailedAllocationOnNode)
	}
	for i, claim := range in.claims {
		a := claimAnswer{Claim: claim.Namespace + "/" + claim.Name}
		if i < len(results) {
			a.Allocation = &results[i]
		}
		out.Claims = append(out.Claims, a)
	}
	encoder := json.NewEncoder(os.Stdout)
	encoder.SetIndent("", "  ")
	return encoder.Encode(out)
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "upstream-allocator: %v\n", err)
		os.Exit(2)
	}
}
